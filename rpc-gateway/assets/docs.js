// The documentation page: reads the gateway's openapi.json (a URL relative to this page, so it
// works behind a path prefix too) and shows its services, operations, parameters, schemas and
// error answers, with a form per operation that sends a request and shows the answer.
// Everything from the document is put in the page as text, never as HTML.
"use strict";

(function () {
  const REF = "#/components/schemas/";
  let doc = null;

  // An element with attributes and children (strings become text nodes).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  // Replaces the children of the element `id` (arrays of children are flattened).
  function put(id, ...children) {
    const target = document.getElementById(id);
    target.replaceChildren();
    target.append(...children.flat(Infinity).filter((c) => c !== null && c !== undefined));
  }

  // The schema a `$ref` names, or the schema itself.
  function resolve(schema) {
    if (schema && typeof schema.$ref === "string" && schema.$ref.startsWith(REF)) {
      const name = schema.$ref.slice(REF.length);
      return ((doc.components || {}).schemas || {})[name] || {};
    }
    return schema || {};
  }

  // A short label of a schema's type: `string`, `array of Item`, `Order`, `any`.
  function typeLabel(schema, depth) {
    if (schema === true || schema === undefined || schema === null) return "any";
    if (schema === false) return "nothing";
    if ((depth || 0) > 3) return "…";
    if (typeof schema.$ref === "string") return schema.$ref.replace(REF, "");
    if (Array.isArray(schema.enum)) return "one of " + schema.enum.map((v) => JSON.stringify(v)).join(", ");
    for (const key of ["oneOf", "anyOf"]) {
      if (Array.isArray(schema[key])) {
        return schema[key].map((s) => typeLabel(s, (depth || 0) + 1)).join(" | ");
      }
    }
    const type = Array.isArray(schema.type) ? schema.type.join(" | ") : schema.type;
    if (type === "array") return "array of " + typeLabel(schema.items, (depth || 0) + 1);
    return type || "any";
  }

  // The names of the schemas `schema` refers to.
  function refsOf(schema, out) {
    out = out || new Set();
    if (Array.isArray(schema)) schema.forEach((s) => refsOf(s, out));
    else if (schema && typeof schema === "object") {
      for (const [key, value] of Object.entries(schema)) {
        if (key === "$ref" && typeof value === "string" && value.startsWith(REF)) out.add(value.slice(REF.length));
        else refsOf(value, out);
      }
    }
    return out;
  }

  // A schema: its type label, then the whole schema as JSON (expandable) with links to the
  // named schemas it refers to.
  function schemaView(schema) {
    const refs = [...refsOf(schema)].sort();
    return el("span", {},
      el("span", { class: "type", text: typeLabel(schema) }),
      el("details", { class: "schema" },
        el("summary", { text: "schema" }),
        el("pre", { text: JSON.stringify(schema === undefined ? {} : schema, null, 2) }),
        refs.length ? el("div", {}, "Refers to: ",
          refs.map((name, i) => [i ? ", " : "", el("a", { href: "#schema-" + name, text: name })])) : null));
  }

  // A value of the schema's shape to start the body from.
  function example(schema, depth) {
    schema = resolve(schema);
    if (depth > 4 || schema === true || schema === false) return null;
    if (schema.default !== undefined) return schema.default;
    if (Array.isArray(schema.enum) && schema.enum.length) return schema.enum[0];
    for (const key of ["oneOf", "anyOf"]) {
      if (Array.isArray(schema[key]) && schema[key].length) return example(schema[key][0], depth + 1);
    }
    let type = schema.type;
    if (Array.isArray(type)) type = type.find((t) => t !== "null") || "null";
    switch (type) {
      case "string": return "";
      case "integer": case "number": return 0;
      case "boolean": return false;
      case "array": return [];
      case "null": return null;
      case "object": {
        const out = {};
        for (const [name, prop] of Object.entries(schema.properties || {})) out[name] = example(prop, depth + 1);
        return out;
      }
      default: return schema.properties ? example({ ...schema, type: "object" }, depth) : null;
    }
  }

  // A parameter's schema: its own, or that of its JSON content (an array or object argument,
  // sent as JSON text).
  function paramSchema(p) {
    return p.schema || (((p.content || {})["application/json"]) || {}).schema;
  }

  function bodySchema(op) {
    const content = ((op.requestBody || {}).content || {})["application/json"];
    return content ? content.schema : undefined;
  }

  // The "try it" form of one operation.
  function tryIt(method, path, op) {
    const params = op.parameters || [];
    const inputs = params.map((p) => {
      const input = el("input", { name: p.name, placeholder: typeLabel(paramSchema(p)) });
      return { param: p, input, label: el("label", {}, el("span", { text: `${p.name} (${p.in})` }), input) };
    });
    const schema = bodySchema(op);
    const body = schema === undefined ? null
      : el("textarea", { spellcheck: "false" });
    if (body) body.value = JSON.stringify(example(schema, 0), null, 2);
    const answer = el("div", { class: "answer" });
    const form = el("form", { class: "try" },
      el("h3", { text: "Try it" }),
      inputs.map((i) => i.label),
      body ? el("label", {}, el("span", { text: "Body (JSON)" }), body) : null,
      el("button", { type: "submit", text: `Send ${method.toUpperCase()}` }),
      answer);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      let url = path;
      const query = new URLSearchParams();
      for (const { param, input } of inputs) {
        if (param.in === "path") url = url.replace(`{${param.name}}`, encodeURIComponent(input.value));
        else if (param.in === "query" && (input.value !== "" || param.required)) query.append(param.name, input.value);
      }
      const qs = query.toString();
      const target = new URL("." + url + (qs ? "?" + qs : ""), location.href);
      const headers = { accept: "application/json" };
      const init = { method: method.toUpperCase(), headers };
      if (body && method !== "get" && method !== "head") {
        headers["content-type"] = "application/json";
        init.body = body.value;
      }
      const token = document.getElementById("token").value;
      if (token) headers.authorization = "Bearer " + token;
      answer.replaceChildren(el("p", { text: `${init.method} ${target.pathname}${target.search} …` }));
      const started = performance.now();
      try {
        const res = await fetch(target, init);
        const text = await res.text();
        let shown = text;
        try { shown = JSON.stringify(JSON.parse(text), null, 2); } catch (_) { /* not JSON: as it is */ }
        const ms = Math.round(performance.now() - started);
        const retry = res.headers.get("retry-after");
        answer.replaceChildren(
          el("p", {},
            el("span", { class: "status " + (res.ok ? "ok" : "bad"), text: `${res.status} ${res.statusText}` }),
            ` in ${ms} ms`, retry ? ` · Retry-After: ${retry}` : ""),
          el("pre", { class: "body", text: shown }));
      } catch (e) {
        answer.replaceChildren(el("p", { class: "error", text: `The request failed: ${e.message}. Is the gateway up?` }));
      }
    });
    return form;
  }

  function operationView(method, path, op) {
    const params = op.parameters || [];
    const schema = bodySchema(op);
    const responses = Object.entries(op.responses || {});
    return el("details", { class: "op", id: "op-" + (op.operationId || method + path),
      "data-search": [method, path, op.operationId, op.summary].join(" ").toLowerCase() },
      el("summary", {},
        el("span", { class: "method " + method, text: method.toUpperCase() }),
        el("code", { class: "path", text: path }),
        el("span", { class: "summary", text: op.summary || op.operationId || "" })),
      el("div", { class: "body" },
        el("p", {}, "Entry ", el("code", { text: op.operationId || "" })),
        op.description ? el("div", { class: "doc", text: op.description }) : null,
        params.length ? [el("h3", { text: "Parameters" }), el("table", {},
          el("tr", {}, ["name", "in", "required", "schema"].map((h) => el("th", { text: h }))),
          params.map((p) => el("tr", {},
            el("td", {}, el("code", { text: p.name })), el("td", { text: p.in }),
            el("td", { text: p.required ? "yes" : "no" }), el("td", {}, schemaView(paramSchema(p))))))] : null,
        schema !== undefined ? [el("h3", { text: "Body (application/json)" }),
          op.requestBody.description ? el("p", { text: op.requestBody.description }) : null,
          schemaView(schema)] : null,
        el("h3", { text: "Responses" }),
        el("table", {},
          el("tr", {}, ["status", "meaning", "body"].map((h) => el("th", { text: h }))),
          responses.map(([status, r]) => el("tr", {},
            el("td", { text: status }),
            el("td", { text: r.description || "" }),
            el("td", {}, schemaView((((r.content || {})["application/json"]) || {}).schema))))),
        tryIt(method, path, op)));
  }

  function render() {
    const info = doc.info || {};
    document.title = info.title || "API";
    document.getElementById("title").replaceChildren(info.title || "API",
      el("span", { class: "version", text: info.version ? "v" + info.version : "" }));
    document.getElementById("description").textContent = info.description || "";
    const schemes = (doc.components || {}).securitySchemes || {};
    if (Object.values(schemes).some((s) => s.scheme === "bearer")) {
      document.getElementById("token-box").classList.remove("hidden");
    }

    // Operations by service (tag), services and operations sorted.
    const byService = new Map();
    const errors = new Map();
    for (const [path, item] of Object.entries(doc.paths || {})) {
      for (const [method, op] of Object.entries(item)) {
        if (!op || typeof op !== "object" || !op.responses) continue;
        const service = (op.tags || ["(untagged)"])[0];
        if (!byService.has(service)) byService.set(service, []);
        byService.get(service).push({ method, path, op });
        for (const [status, r] of Object.entries(op.responses)) {
          if (Number(status) >= 400 && !errors.has(status)) errors.set(status, r);
        }
      }
    }
    const services = [...byService.keys()].sort();
    const status = document.getElementById("status");
    const count = services.reduce((n, s) => n + byService.get(s).length, 0);
    status.textContent = count ? `${count} operation${count === 1 ? "" : "s"} in ${services.length} service${services.length === 1 ? "" : "s"}.`
      : "No operations: no server publishes a unary entry yet. Reload when servers are up.";

    put("toc", services.length ? el("p", {}, "Services: ",
      services.map((s, i) => [i ? " · " : "", el("a", { href: "#service-" + s, text: s })])) : null);
    put("services", services.map((service) => el("section", { class: "service", id: "service-" + service },
      el("h2", { text: service }),
      byService.get(service)
        .sort((a, b) => (a.path + a.method).localeCompare(b.path + b.method))
        .map(({ method, path, op }) => operationView(method, path, op)))));

    put("errors", errors.size ? [el("h2", { text: "Error answers" }),
      el("p", {}, "A failed call answers with one of these statuses and a JSON body ",
        el("code", { text: '{"code": <call status>, "message": "...", "error": <typed error>}' }),
        "; what the gateway refuses itself, before any call, with ",
        el("code", { text: '{"error": "..."}' }), " saying what to send instead."),
      el("table", {}, el("tr", {}, el("th", { text: "status" }), el("th", { text: "meaning" })),
        [...errors.entries()].sort().map(([s, r]) => el("tr", {}, el("td", { text: s }), el("td", { text: r.description || "" }))))] : []);

    const schemas = Object.entries((doc.components || {}).schemas || {}).sort(([a], [b]) => a.localeCompare(b));
    put("schemas", schemas.length ? [el("h2", { text: "Schemas" }),
      schemas.map(([name, schema]) => el("div", { id: "schema-" + name },
        el("code", { text: name }), " ", schemaView(schema)))] : []);

    // A link to an operation or a schema (`#op-<entry id>`, `#schema-<name>`) opens it.
    const target = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target) {
      if (target.tagName === "DETAILS") target.open = true;
      target.scrollIntoView();
    }
  }

  document.getElementById("filter").addEventListener("input", (event) => {
    const words = event.target.value.toLowerCase().split(/\s+/).filter(Boolean);
    for (const op of document.querySelectorAll("details.op")) {
      const text = op.getAttribute("data-search") || "";
      op.classList.toggle("hidden", !words.every((w) => text.includes(w)));
    }
  });

  // Loads the document (with the token, when one is entered) and shows it. A gateway with a
  // token refuses the document without it (401): the token box is shown, and Enter in it loads
  // the document again with the token.
  async function load() {
    const status = document.getElementById("status");
    const token = document.getElementById("token").value;
    const headers = { accept: "application/json" };
    if (token) headers.authorization = "Bearer " + token;
    try {
      const res = await fetch("openapi.json", { headers });
      if (res.status === 401) {
        document.getElementById("token-box").classList.remove("hidden");
        status.className = "error";
        status.textContent = token
          ? "The gateway refused this token: enter its bearer token and press Enter."
          : "This gateway needs a token: enter its bearer token and press Enter.";
        return;
      }
      if (!res.ok) throw new Error(`openapi.json answered ${res.status} ${res.statusText}`);
      doc = await res.json();
    } catch (e) {
      status.className = "error";
      status.textContent = `Could not load openapi.json (${e.message}); reload when the gateway is up.`;
      return;
    }
    status.className = "";
    render();
  }

  document.getElementById("token").addEventListener("keydown", (event) => {
    if (event.key === "Enter") load();
  });
  load();
})();
