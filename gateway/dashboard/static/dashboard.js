// Keeps the view live: fetches its fragment (rendered and escaped by the server) every
// data-refresh-s seconds and puts it in place; asks before the buttons that say data-confirm.
"use strict";

function refresh(main) {
  if (document.hidden) return;
  fetch(main.dataset.src, {credentials: "same-origin", cache: "no-store"})
    .then(function (response) {
      if (response.status === 401) { window.location.assign("/dashboard/login"); return null; }
      return response.ok ? response.text() : null;
    })
    .then(function (html) {
      if (html !== null) { main.innerHTML = html; main.dataset.refreshed = String(Date.now()); }
    })
    .catch(function () { /* the next round tries again */ });
}

document.addEventListener("DOMContentLoaded", function () {
  var main = document.getElementById("live");
  if (main && main.dataset.src) {
    setInterval(function () { refresh(main); }, 1000 * Number(main.dataset.refreshS || 2));
  }
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) event.preventDefault();
  });
});
