// Live dashboards: draw the figures of the first websocket message (the recent history), then append
// each later message's points with Plotly.extendTraces, matching traces by uid. Every figure's div
// carries data-points (points drawn) and #live data-updates (messages applied), read by the browser test.
(function () {
  "use strict";
  var MAX_POINTS = 900; // 15 minutes at one sample a second, as the server keeps
  var root = document.getElementById("live");
  var statusEl = document.getElementById("live-status");
  if (!root || typeof Plotly === "undefined") {
    if (statusEl) statusEl.textContent = "charts unavailable";
    return;
  }
  var config = { responsive: true, displaylogo: false };
  var updates = 0;

  function chart(fid) { return document.getElementById("fig-" + fid); }

  function countPoints(el) {
    var total = 0;
    (el.data || []).forEach(function (trace) { total += (trace.x || []).length; });
    el.dataset.points = String(total);
  }

  function uidIndex(el) {
    var index = {};
    (el.data || []).forEach(function (trace, i) { if (trace.uid) index[trace.uid] = i; });
    return index;
  }

  function drawHistory(figures) {
    Object.keys(figures).forEach(function (fid) {
      var el = chart(fid);
      if (!el) return;
      var figure = figures[fid];
      Plotly.react(el, figure.data, figure.layout, config);
      countPoints(el);
    });
  }

  function applyUpdate(traces) {
    Object.keys(traces).forEach(function (fid) {
      var el = chart(fid);
      if (!el || !el.data) return;
      var index = uidIndex(el);
      var known = { x: [], y: [] };
      var positions = [];
      var added = [];
      traces[fid].forEach(function (trace) {
        if (Object.prototype.hasOwnProperty.call(index, trace.uid)) {
          positions.push(index[trace.uid]);
          known.x.push(trace.x);
          known.y.push(trace.y);
        } else {
          added.push(trace); // a new entitlement, replica or denial reason: its template comes along
        }
      });
      if (positions.length) Plotly.extendTraces(el, known, positions, MAX_POINTS);
      if (added.length) Plotly.addTraces(el, added);
      countPoints(el);
    });
    updates += 1;
    root.dataset.updates = String(updates);
  }

  window.tokenpoolsLiveSocket(root.dataset.ws, statusEl, function (message) {
    if (message.type === "history") drawHistory(message.figures);
    else if (message.type === "update") applyUpdate(message.traces);
  });
})();
