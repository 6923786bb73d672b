// gym-runtime view's keyboard navigation: the one script its pages load (their Content-Security-Policy allows this
// file alone). It follows the links the server rendered with a data-key (j/k rollout, f/F failure, g/G group,
// s/S step, u group page, v tokens, r trajectory) and scrolls to the next or previous turn (t/T). It reads no row
// and inserts nothing into the page.
"use strict";
document.addEventListener("keydown", function (e) {
  if (e.ctrlKey || e.metaKey || e.altKey || e.isComposing) return;
  var target = e.target;
  if (target && target.closest && target.closest("input, select, textarea, [contenteditable]")) return;
  if (e.key === "t" || e.key === "T") {
    var turns = document.querySelectorAll("section.turn, section.block");
    var here = window.scrollY;
    var next = null;
    for (var i = 0; i < turns.length; i++) {
      var top = turns[i].getBoundingClientRect().top + window.scrollY;
      if (e.key === "t" && top > here + 2) { next = turns[i]; break; }
      if (e.key === "T" && top < here - 2) next = turns[i];
    }
    if (next) { next.scrollIntoView(); e.preventDefault(); }
    return;
  }
  var links = document.querySelectorAll("a[data-key]");
  for (var k = 0; k < links.length; k++) {
    if (links[k].getAttribute("data-key") === e.key) {
      e.preventDefault();
      window.location.href = links[k].href;
      return;
    }
  }
});
