// Draws the usage page's daily chart from the figure the server embedded (no inline script).
document.addEventListener("DOMContentLoaded", () => {
  const element = document.getElementById("usage-daily");
  if (element && window.Plotly) {
    const figure = JSON.parse(element.dataset.figure);
    window.Plotly.newPlot(element, figure.data, figure.layout, {responsive: true, displaylogo: false});
  }
});
