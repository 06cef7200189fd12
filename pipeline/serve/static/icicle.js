/* tbpipe's icicle graph: a tree of frames, the root at the top, each box as wide as its events.
 *
 * Data: {name, kind, file?, line?, value, base?, children?}; with `base` on the nodes it is a diff:
 * boxes are as wide as the larger of the two weights and coloured by the change (red: more events
 * in the candidate, green: fewer). A click on a box zooms to it (its ancestors stay, full width);
 * a click on the root, or "reset", zooms out. Plain DOM, no dependencies: the same file serves the
 * service's pages and can be inlined into a self-contained report.
 *
 * A graph loaded from the API (data-icicle-src) has the focus modes (program, Python, native, all
 * frames): the server focuses the tree (tbpipe.pipeline.stacks.focus), this file only asks for the
 * mode, kept in the page's URL as ?frames=MODE. The search box highlights the boxes whose function
 * or file contains the text and says what share of the events runs under them.
 *
 *   TbpipeIcicle.render(element, data)     or   <div class="icicle" data-icicle-src="/api/...">
 */
(function (global) {
  "use strict";
  var ROW = 18;
  var MODES = [["program", "program"], ["python", "Python"], ["native", "native"], ["all", "all frames"]];

  function pageMode() {
    var mode = new URLSearchParams(window.location.search).get("frames");
    return MODES.some(function (m) { return m[0] === mode; }) ? mode : "program";
  }

  function setPageMode(mode) {
    var url = new URL(window.location.href);
    if (mode === "program") url.searchParams.delete("frames"); else url.searchParams.set("frames", mode);
    history.replaceState(null, "", url);
  }

  function weight(node, diff) { return diff ? Math.max(node.value || 0, node.base || 0) : (node.value || 0); }

  function layout(root, diff) {
    var items = [];
    (function visit(node, depth, x0, x1, parent) {
      var item = { node: node, depth: depth, x0: x0, x1: x1, parent: parent, index: items.length };
      items.push(item);
      var total = weight(node, diff), x = x0;
      (node.children || []).forEach(function (child) {
        var w = total > 0 ? (x1 - x0) * weight(child, diff) / total : 0;
        visit(child, depth + 1, x, x + w, item);
        x += w;
      });
    })(root, 0, 0, 1, null);
    return items;
  }

  function hue(text) {
    var h = 0;
    for (var i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) >>> 0;
    return h;
  }

  function colour(node, diff) {
    if (node.kind === "root") return "hsl(210, 12%, 82%)";
    if (diff) {
      var v = node.value || 0, b = node.base || 0, m = Math.max(v, b);
      var r = m > 0 ? (v - b) / m : 0;
      if (Math.abs(r) < 0.02) return "hsl(210, 10%, 86%)";
      var light = 88 - Math.round(Math.min(1, Math.abs(r)) * 40);
      return r > 0 ? "hsl(2, 75%, " + light + "%)" : "hsl(135, 50%, " + light + "%)";
    }
    var jitter = hue(node.name || "") % 14;
    if (node.kind === "python") return "hsl(" + (205 + jitter) + ", 65%, " + (78 - jitter / 2) + "%)";
    if (node.kind === "native") return "hsl(" + (30 + jitter) + ", 70%, " + (74 - jitter / 2) + "%)";
    if (node.kind === "event") return "hsl(" + (350 + jitter) + ", 70%, 72%)";
    if (node.kind === "folded") return "hsl(210, 8%, 88%)";
    return "hsl(0, 0%, 80%)";
  }

  function number(x) {
    if (x === undefined || x === null) return "";
    return Math.abs(x) >= 100 ? Math.round(x).toLocaleString("en-US") : String(Math.round(x * 1000) / 1000);
  }

  function describe(node, root, diff) {
    var where = node.file ? "\n" + node.file + (node.line !== undefined ? ":" + node.line : "") : "";
    var share = root.value ? " (" + (100 * (node.value || 0) / root.value).toFixed(1) + "%)" : "";
    var text = (node.kind === "root" ? "" : "[" + node.kind + "] ") + node.name + where + "\nevents: " + number(node.value) + share;
    if (diff) {
      var delta = (node.value || 0) - (node.base || 0);
      text += "\nbaseline: " + number(node.base) + "\nchange: " + (delta >= 0 ? "+" : "") + number(delta);
    }
    return text;
  }

  function render(element, data, options) {
    options = options || {};
    var root = data.tree || data;
    var diff = root.base !== undefined;
    var items = layout(root, diff);
    var depth = items.reduce(function (d, it) { return Math.max(d, it.depth); }, 0);
    element.innerHTML = "";
    element.classList.add("icicle");
    var bar = document.createElement("div");
    bar.className = "icicle-bar";
    var reset = document.createElement("button");
    reset.type = "button";
    reset.className = "icicle-reset";
    reset.textContent = "reset zoom";
    var crumb = document.createElement("span");
    crumb.className = "icicle-crumb";
    if (options.mode) bar.appendChild(modeSwitch(options.mode, options.onMode));
    var search = document.createElement("input");
    search.type = "search";
    search.className = "icicle-search";
    search.placeholder = "search functions, files";
    search.setAttribute("aria-label", "search the graph");
    var found = document.createElement("span");
    found.className = "icicle-found";
    bar.appendChild(search);
    bar.appendChild(found);
    bar.appendChild(reset);
    bar.appendChild(crumb);
    element.appendChild(bar);
    var canvas = document.createElement("div");
    canvas.className = "icicle-canvas";
    canvas.style.height = (depth + 1) * ROW + "px";
    element.appendChild(canvas);
    var boxes = items.map(function (item) {
      var box = document.createElement("div");
      box.className = "icicle-node " + item.node.kind;
      box.style.top = item.depth * ROW + "px";
      box.style.background = colour(item.node, diff);
      box.title = describe(item.node, root, diff);
      box.dataset.name = item.node.name;
      box.dataset.kind = item.node.kind;
      box.dataset.depth = item.depth;
      box.dataset.value = item.node.value || 0;
      box.dataset.index = item.index;
      var label = document.createElement("span");
      label.textContent = item.node.name;
      box.appendChild(label);
      box.addEventListener("click", function () { zoom(item); });
      canvas.appendChild(box);
      return box;
    });

    function zoom(focus) {
      var span = focus.x1 - focus.x0 || 1;
      var chain = [];
      for (var up = focus; up; up = up.parent) chain.push(up.index);
      items.forEach(function (item, i) {
        var box = boxes[i], left, width;
        if (chain.indexOf(item.index) >= 0) {
          left = 0; width = 1;
        } else if (item.depth > focus.depth && item.x0 >= focus.x0 - 1e-12 && item.x1 <= focus.x1 + 1e-12) {
          left = (item.x0 - focus.x0) / span; width = (item.x1 - item.x0) / span;
        } else {
          box.style.display = "none";
          return;
        }
        if (width * canvas.clientWidth < 1 && canvas.clientWidth > 0) { box.style.display = "none"; return; }
        box.style.display = "";
        box.style.left = (left * 100) + "%";
        box.style.width = (width * 100) + "%";
        box.classList.toggle("focus", item === focus);
      });
      element.dataset.focus = focus.node.name;
      element.dataset.focusDepth = focus.depth;
      var names = chain.slice().reverse().map(function (i) { return items[i].node.name; });
      crumb.textContent = chain.length > 1
        ? (names.length > 5 ? "\u2026 \u203a " : "") + names.slice(-5).join(" \u203a ")
        : "click a box to zoom";
    }
    // Matches are counted once however deep they nest: a match inside a match adds nothing.
    function find(text) {
      var needle = text.trim().toLowerCase(), boxesFound = 0, weight = 0;
      items.forEach(function (item, i) {
        var node = item.node;
        var hit = needle !== "" && item.depth > 0 &&
          ((node.name || "").toLowerCase().indexOf(needle) >= 0 || (node.file || "").toLowerCase().indexOf(needle) >= 0);
        boxes[i].classList.toggle("match", hit);
        item.match = hit;
        if (!hit) return;
        boxesFound++;
        for (var up = item.parent; up; up = up.parent) if (up.match) return;
        weight += node.value || 0;
      });
      var share = root.value ? 100 * weight / root.value : 0;
      element.dataset.matches = boxesFound;
      element.dataset.matchShare = share.toFixed(1);
      found.textContent = needle === "" ? "" : boxesFound === 0 ? "no match"
        : boxesFound + " box" + (boxesFound === 1 ? "" : "es") + ", " + share.toFixed(1) + "% of events (" + number(weight) + ")";
    }
    search.addEventListener("input", function () { find(search.value); });
    reset.addEventListener("click", function () { zoom(items[0]); });
    zoom(items[0]);
    element.dataset.nodes = items.length;
    element.dataset.total = root.value || 0;
    if (options.search) { search.value = options.search; find(options.search); }
    return { zoom: function (i) { zoom(items[i]); }, items: items, find: find };
  }

  function modeSwitch(current, onMode) {
    var group = document.createElement("span");
    group.className = "icicle-modes";
    group.setAttribute("role", "group");
    group.setAttribute("aria-label", "frames shown");
    MODES.forEach(function (mode) {
      var button = document.createElement("button");
      button.type = "button";
      button.dataset.mode = mode[0];
      button.textContent = mode[1];
      if (mode[0] === current) button.classList.add("on");
      button.setAttribute("aria-pressed", mode[0] === current ? "true" : "false");
      button.addEventListener("click", function () { if (mode[0] !== current) onMode(mode[0]); });
      group.appendChild(button);
    });
    return group;
  }

  function load(element, mode) {
    mode = mode || pageMode();
    var previous = element.querySelector(".icicle-search");
    var search = previous ? previous.value : "";
    var url = new URL(element.dataset.icicleSrc, window.location.href);
    url.searchParams.set("frames", mode);
    element.textContent = "loading…";
    element.dataset.frames = mode;
    fetch(url, { headers: { accept: "application/json" } })
      .then(function (response) {
        return response.json().then(function (body) {
          if (!response.ok) throw new Error(body.error || response.statusText);
          return body;
        });
      })
      .then(function (body) {
        if (!body.tree || !body.tree.value && !body.tree.base) {
          element.textContent = "no events to show";
          element.dataset.nodes = 0;
          return;
        }
        render(element, body, {
          mode: mode,
          search: search,
          onMode: function (chosen) { setPageMode(chosen); load(element, chosen); }
        });
        element.dispatchEvent(new CustomEvent("icicle-ready", { bubbles: true }));
      })
      .catch(function (error) {
        element.textContent = "could not load the graph: " + error.message;
        element.classList.add("error");
      });
  }

  global.TbpipeIcicle = { render: render, load: load };
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-icicle-src]").forEach(function (element) { load(element); });
    document.querySelectorAll("script[type='application/json'][data-icicle-for]").forEach(function (script) {
      var target = document.getElementById(script.dataset.icicleFor);
      if (target) render(target, JSON.parse(script.textContent));
    });
  });
})(window);
