// Hover values and legend toggles for the charts of an `xprep inspect --html` page. It only reads what the
// page holds (data-* attributes written by prep/charts.py) and changes no number: without it, the page reads the same.
(() => {
  "use strict";
  const tip = document.getElementById("tip");
  const parsed = new WeakMap();

  // data-value / data-x arrays; NaN and Infinity (a diverged step) are JSON to Python, not to JavaScript
  function series(path) {
    if (!parsed.has(path)) {
      const read = (text) => JSON.parse(text.replace(/-?Infinity|NaN/g, "null"));
      parsed.set(path, { x: read(path.dataset.x), y: read(path.dataset.value) });
    }
    return parsed.get(path);
  }

  function place(event) {
    const pad = 14, width = tip.offsetWidth, height = tip.offsetHeight;
    const left = event.clientX + pad + width > window.innerWidth ? event.clientX - pad - width : event.clientX + pad;
    const top = event.clientY + pad + height > window.innerHeight ? event.clientY - pad - height : event.clientY + pad;
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${Math.max(0, top)}px`;
  }

  function row(text, colour) {
    const line = document.createElement("div");
    line.className = "row";
    if (colour) {
      const swatch = document.createElement("i");
      swatch.style.background = colour;
      line.append(swatch);
    }
    line.append(text);
    return line;
  }

  function show(event, head, rows) {
    tip.replaceChildren();
    if (head) {
      const h = row(head);
      h.classList.add("head");
      tip.append(h);
    }
    rows.forEach(([text, colour]) => tip.append(row(text, colour)));
    tip.hidden = false;
    place(event);
  }

  function hide() {
    tip.hidden = true;
  }

  const fmt = (v) => (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toPrecision(4) : String(+v.toPrecision(5)));

  // Bars, markers and cut names: their data-tip.
  document.addEventListener("mouseover", (event) => {
    const target = event.target.closest && event.target.closest("[data-tip]");
    if (target && !target.closest('svg[data-kind="line"]')) show(event, null, [[target.dataset.tip]]);
  });
  document.addEventListener("mousemove", (event) => {
    if (!tip.hidden && event.target.closest && event.target.closest("[data-tip]")) place(event);
  });
  document.addEventListener("mouseout", (event) => {
    if (event.target.closest && event.target.closest("[data-tip]")) hide();
  });

  // Line charts: every visible series' value at the step nearest the pointer, and the checkpoints there.
  function nearest(xs, ys, x) {
    let best = -1;
    for (let k = 0; k < xs.length; k += 1) {
      if (ys[k] !== null && (best < 0 || Math.abs(xs[k] - x) < Math.abs(xs[best] - x))) best = k;
    }
    return best;
  }

  function hover(svg, event) {
    const point = new DOMPoint(event.clientX, event.clientY).matrixTransform(svg.getScreenCTM().inverse());
    const left = +svg.dataset.left, right = +svg.dataset.right, lo = +svg.dataset.xLo, hi = +svg.dataset.xHi;
    const guide = svg.querySelector(".guide");
    if (point.x < left - 4 || point.x > right + 4) {
      guide.setAttribute("visibility", "hidden");
      hide();
      return;
    }
    const x = lo + ((point.x - left) / (right - left)) * (hi - lo);
    const paths = [...svg.querySelectorAll("g.series:not(.off) > path")];
    let at = null;
    paths.forEach((path) => {
      const s = series(path), k = nearest(s.x, s.y, x);
      if (k >= 0 && (at === null || Math.abs(s.x[k] - x) < Math.abs(at - x))) at = s.x[k];
    });
    if (at === null) return;
    const rows = [];
    paths.forEach((path) => {
      const s = series(path), k = s.x.indexOf(at);
      if (k >= 0 && s.y[k] !== null) rows.push([`${path.parentNode.dataset.label}: ${fmt(s.y[k])}`, path.getAttribute("stroke")]);
    });
    svg.querySelectorAll("g.marker:not(.off)").forEach((m) => {
      if (+m.querySelector("line").dataset.value === at) rows.push([m.dataset.tip, null]);
    });
    const px = left + ((at - lo) / (hi - lo)) * (right - left);
    guide.setAttribute("x1", px);
    guide.setAttribute("x2", px);
    guide.setAttribute("visibility", "visible");
    show(event, `step ${at}`, rows);
  }

  document.querySelectorAll('svg.chart[data-kind="line"]').forEach((svg) => {
    svg.addEventListener("mousemove", (event) => hover(svg, event));
    svg.addEventListener("mouseleave", () => {
      svg.querySelector(".guide").setAttribute("visibility", "hidden");
      hide();
    });
  });

  // Legend keys show or hide their series (or run) in their own chart.
  function refresh(figure) {
    const off = (name) => new Set([...figure.querySelectorAll(`.key[aria-pressed="false"][data-${name}]`)]
      .map((key) => key.dataset[name]));
    const series = off("series"), runs = off("run");
    figure.querySelectorAll("svg [data-series], svg [data-run]").forEach((el) => {
      el.classList.toggle("off", series.has(el.dataset.series) || runs.has(el.dataset.run));
    });
  }

  document.querySelectorAll(".legend .key").forEach((key) => {
    key.addEventListener("click", () => {
      key.setAttribute("aria-pressed", key.getAttribute("aria-pressed") === "false" ? "true" : "false");
      refresh(key.closest("figure"));
    });
  });
})();
