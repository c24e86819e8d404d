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

  window.tokenpoolsLiveSocket(root.dataset.ws, statusEl, function (message) {
    if (message.type === "overview") apply(message);
  });
})();
