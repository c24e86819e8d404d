// Draws the What if page's charts from the figures the server embedded (no inline script).
document.addEventListener("DOMContentLoaded", () => {
  if (!window.Plotly) return;
  for (const element of document.querySelectorAll("[data-figure]")) {
    const figure = JSON.parse(element.dataset.figure);
    window.Plotly.newPlot(element, figure.data, figure.layout, {responsive: true, displaylogo: false});
  }
});
