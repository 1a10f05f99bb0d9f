/* attnlab dashboard: draws the figures stored as JSON in the page, runs the selectors, sorts the runs table. */
(function () {
  "use strict";
  var CONFIG = {responsive: true, displaylogo: false};

  function json(id) {
    var node = document.getElementById(id);
    return node ? JSON.parse(node.textContent) : null;
  }

  function draw(div, fig) {
    Plotly.newPlot(div, fig.data, fig.layout, CONFIG);
  }

  function drawAll() {
    document.querySelectorAll("div.plot[data-figure]").forEach(function (div) {
      var fig = json(div.dataset.figure);
      if (fig) { draw(div, fig); }
    });
  }

  // <select data-choices="ID" data-target="DIV"> picks one figure of the JSON object ID (keyed by option value)
  function figureSelectors() {
    document.querySelectorAll("select[data-choices]").forEach(function (select) {
      var choices = json(select.dataset.choices);
      var div = document.getElementById(select.dataset.target);
      select.addEventListener("change", function () {
        Plotly.react(div, choices[select.value].data, choices[select.value].layout, CONFIG);
      });
    });
  }

  // <select data-images="ID" data-target="IMG"> swaps the image (JSON ID: [{src, caption}, ...])
  function imageSelectors() {
    document.querySelectorAll("select[data-images]").forEach(function (select) {
      var images = json(select.dataset.images);
      var img = document.getElementById(select.dataset.target);
      select.addEventListener("change", function () {
        var chosen = images[Number(select.value)];
        img.src = chosen.src;
        img.alt = chosen.caption;
        img.parentNode.querySelector("figcaption").textContent = chosen.caption;
      });
    });
  }

  // click a header to sort (numbers by their data-v value, text naturally; empty cells last)
  function sortableTables() {
    document.querySelectorAll("table.sortable th").forEach(function (th, i) {
      th.addEventListener("click", function () {
        var body = th.closest("table").tBodies[0], rows = Array.prototype.slice.call(body.rows);
        var asc = th.dataset.dir !== "asc";
        th.closest("tr").querySelectorAll("th").forEach(function (h) { delete h.dataset.dir; });
        th.dataset.dir = asc ? "asc" : "desc";
        var col = th.cellIndex;
        function key(r) { var v = r.cells[col].dataset.v; return v === undefined ? r.cells[col].textContent : v; }
        rows.sort(function (a, b) {
          var x = key(a), y = key(b);
          if (x === "" && y !== "") { return 1; }
          if (y === "" && x !== "") { return -1; }
          var nx = Number(x), ny = Number(y);
          var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y, undefined, {numeric: true});
          return asc ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  }

  function start() {
    drawAll();
    figureSelectors();
    imageSelectors();
    sortableTables();
    document.body.dataset.ready = "1";
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
