/* Behaviour of tbpipe serve's pages: the SQL page and table filters. Plain DOM, no dependencies. */
(function () {
  "use strict";

  function cell(value) {
    if (value === null || value === undefined) return "";
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }

  function showResult(target, body) {
    target.innerHTML = "";
    var info = document.createElement("p");
    info.className = "muted";
    info.id = "sql-info";
    info.textContent = body.row_count + " row" + (body.row_count === 1 ? "" : "s") +
      (body.truncated ? " (the first " + body.limit + "; more were left out)" : "") + " in " + body.seconds + " s";
    target.appendChild(info);
    var table = document.createElement("table");
    table.id = "sql-result";
    var head = table.insertRow();
    body.columns.forEach(function (name, i) {
      var th = document.createElement("th");
      th.textContent = name;
      th.title = body.types[i];
      head.appendChild(th);
    });
    body.rows.forEach(function (row) {
      var tr = table.insertRow();
      row.forEach(function (value) {
        var td = tr.insertCell();
        td.textContent = cell(value);
        if (typeof value === "number") td.className = "num";
      });
    });
    target.appendChild(table);
  }

  function runSql(form) {
    var sql = form.querySelector("textarea").value;
    var target = document.getElementById("sql-output");
    target.textContent = "running…";
    var url = new URL(form.getAttribute("action"), window.location.href);
    url.searchParams.set("sql", sql);
    history.replaceState(null, "", "?sql=" + encodeURIComponent(sql));
    fetch(url, { headers: { accept: "application/json" } })
      .then(function (response) { return response.json().then(function (body) { return [response, body]; }); })
      .then(function (pair) {
        var response = pair[0], body = pair[1];
        if (!response.ok) {
          target.innerHTML = "";
          var error = document.createElement("div");
          error.className = "verdict bad";
          error.id = "sql-error";
          error.textContent = body.error || response.statusText;
          target.appendChild(error);
          return;
        }
        showResult(target, body);
      })
      .catch(function (error) { target.textContent = "request failed: " + error.message; });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var form = document.getElementById("sql-form");
    if (form) {
      form.addEventListener("submit", function (event) { event.preventDefault(); runSql(form); });
      document.querySelectorAll("[data-canned]").forEach(function (button) {
        button.addEventListener("click", function () {
          form.querySelector("textarea").value = button.dataset.canned;
          runSql(form);
        });
      });
      if (form.querySelector("textarea").value.trim()) runSql(form);
    }
    document.querySelectorAll("input[data-filter-table]").forEach(function (input) {
      input.addEventListener("input", function () {
        var needle = input.value.toLowerCase();
        document.querySelectorAll("#" + input.dataset.filterTable + " tr").forEach(function (row, index) {
          if (index > 0) row.style.display = row.textContent.toLowerCase().indexOf(needle) >= 0 ? "" : "none";
        });
      });
    });
  });
})();
