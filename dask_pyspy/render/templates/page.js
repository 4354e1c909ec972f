document.querySelectorAll("details").forEach(function (d) {
  d.addEventListener("toggle", function () {
    var f = d.querySelector("iframe[data-src]");
    if (d.open && f && !f.src) f.src = f.dataset.src;
  });
});
var download = document.getElementById("download");
if (download) download.addEventListener("click", function () {
  var raw = atob(document.getElementById("speedscope-data").textContent.trim());
  var bytes = new Uint8Array(raw.length);
  for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  var a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([bytes], {type: "application/gzip"}));
  a.download = "profile.speedscope.json.gz";
  document.body.appendChild(a); a.click(); a.remove();
});
