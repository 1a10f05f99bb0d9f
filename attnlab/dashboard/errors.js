/* attnlab dashboard: shows any script error or blocked request at the top of the page (and to tests) */
(function () {
  var seen = [];
  function render() { var d = document.getElementById("js-errors"); if (d) { d.textContent = seen.join("\n"); } }
  function add(message) { seen.push(message); render(); }
  window.addEventListener("error", function (e) { add("Error: " + e.message + " (line " + e.lineno + ")"); });
  window.addEventListener("unhandledrejection", function (e) { add("Unhandled rejection: " + e.reason); });
  document.addEventListener("securitypolicyviolation", function (e) {
    add("CSP: " + e.violatedDirective + " " + e.blockedURI);
  });
  document.addEventListener("DOMContentLoaded", render);
})();
