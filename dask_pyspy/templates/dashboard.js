var refresh = document.getElementById("refresh");
refresh.addEventListener("change", function () {
  var q = new URLSearchParams(location.search); q.set("refresh", refresh.value); location.search = q.toString();
});
if (+refresh.value > 0) setTimeout(function () { location.reload(); }, 1000 * refresh.value);
