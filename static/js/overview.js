// The overview: every message of /ws/overview/ carries the figures (drawn with Plotly.react) and the tables'
// HTML (rendered and escaped by the server's template). #overview data-updates counts the messages applied
// (read by the browser test).
(function () {
  "use strict";
  var root = document.getElementById("overview");
  var statusEl = document.getElementById("overview-status");
  var tables = document.getElementById("overview-tables");
  if (!root) return;
  var config = { responsive: true, displaylogo: false };
  var updates = 0;
  var retryMs = 1000;

  function apply(message) {
    if (typeof Plotly !== "undefined") {
      Object.keys(message.figures || {}).forEach(function (fid) {
        var el = document.getElementById("ov-fig-" + fid);
        if (el) Plotly.react(el, message.figures[fid].data, message.figures[fid].layout, config);
      });
    }
    if (typeof message.tables === "string") tables.innerHTML = message.tables;
    updates += 1;
    root.dataset.updates = String(updates);
  }

  function connect() {
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + window.location.host + root.dataset.ws);
    socket.onopen = function () {
      retryMs = 1000;
      statusEl.textContent = "live";
    };
    socket.onmessage = function (event) {
      var message = JSON.parse(event.data);
      if (message.type === "overview") apply(message);
    };
    socket.onclose = function () {
      statusEl.textContent = "disconnected; retrying";
      window.setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 30000);
    };
  }

  connect();
})();
