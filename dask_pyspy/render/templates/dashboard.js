var refresh = document.getElementById("refresh");
refresh.addEventListener("change", function () {
  var q = new URLSearchParams(location.search); q.set("refresh", refresh.value); location.search = q.toString();
});
if (+refresh.value > 0) setTimeout(function () { location.reload(); }, 1000 * refresh.value);
// Choosing a range on a timeline chart reloads the page with start= and stop= (Unix s); the
// charts come after this script, so it looks for them once the page is read.
document.addEventListener("DOMContentLoaded", function () {
  var timeline = document.querySelector(".timeline");
  if (!timeline) return;
  var t0 = +timeline.dataset.start, step = +timeline.dataset.step, steps = +timeline.dataset.steps;
  document.querySelectorAll(".tl-chart, .tl-stalls").forEach(function (svg) {
    var left = +svg.dataset.left, plot = +svg.dataset.plot, box = svg.querySelector(".tl-select"), from = null;
    function x(e) {
      var p = new DOMPoint(e.clientX, e.clientY).matrixTransform(svg.getScreenCTM().inverse());
      return Math.min(Math.max(p.x, left), left + plot);
    }
    function when(at) { return t0 + (at - left) / plot * steps * step; }
    svg.addEventListener("mousedown", function (e) { from = x(e); e.preventDefault(); });
    svg.addEventListener("mousemove", function (e) {
      if (from === null) return;
      var to = x(e);
      box.setAttribute("x", Math.min(from, to)); box.setAttribute("width", Math.abs(to - from));
    });
    svg.addEventListener("mouseup", function (e) {
      if (from === null) return;
      var a = when(Math.min(from, x(e))), b = when(Math.max(from, x(e)));
      from = null;
      if (b - a < step) { a = t0 + Math.floor((a - t0) / step) * step; b = a + step; }  // a click: its step
      var q = new URLSearchParams(location.search);
      q.delete("last"); q.set("start", a.toFixed(3)); q.set("stop", b.toFixed(3)); q.set("refresh", "0");
      location.search = q.toString();
    });
  });
});
