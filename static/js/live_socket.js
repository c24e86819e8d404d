// One websocket that stays open: reconnects with backoff (1 s doubling to 30 s) and says where it stands in
// `statusEl`. A refused socket (signed out, no access) and a restarting server look alike here: both retry slowly.
// Used by the live pages (live.js) and the overview (overview.js).
window.tokenpoolsLiveSocket = function (path, statusEl, onMessage) {
  "use strict";
  var retryMs = 1000;
  function connect() {
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + window.location.host + path);
    socket.onopen = function () {
      retryMs = 1000;
      statusEl.textContent = "live";
    };
    socket.onmessage = function (event) {
      onMessage(JSON.parse(event.data));
    };
    socket.onclose = function () {
      statusEl.textContent = "disconnected; retrying";
      window.setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 30000);
    };
  }
  connect();
};
