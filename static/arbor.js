/* Arbor's browser behaviour: streamed chat turns and keyboard navigation.
 * Loaded as a static file: the Content-Security-Policy forbids inline script. */
(function () {
  "use strict";

  function csrfToken() {
    try {
      return JSON.parse(document.body.getAttribute("hx-headers") || "{}")["X-CSRFToken"] || "";
    } catch (e) {
      return "";
    }
  }

  function bubble(role, text) {
    var li = document.createElement("li");
    li.className = "msg " + role + " live";
    var body = document.createElement("div");
    body.className = "live-text";
    body.textContent = text || "";
    li.appendChild(body);
    return li;
  }

  // "⚙ name…" under a live answer: a tool the model called (as the page renders it).
  function toolNote(name) {
    var note = document.createElement("div");
    note.className = "live-tool";
    note.textContent = "⚙ " + (name || "tool") + "…";
    return note;
  }

  function refreshChat() {
    var chat = document.getElementById("chat");
    if (chat && window.htmx) {
      window.htmx.ajax("GET", chat.getAttribute("data-refresh-url"), {
        target: "#chat",
        swap: "outerHTML",
      });
    }
  }

  function handleEvent(block, answer, out) {
    var name = "message";
    var data = "";
    block.split("\n").forEach(function (line) {
      if (line.indexOf("event: ") === 0) name = line.slice(7);
      else if (line.indexOf("data: ") === 0) data += line.slice(6);
    });
    var payload = {};
    try {
      payload = data ? JSON.parse(data) : {};
    } catch (e) {
      return;
    }
    if (name === "attempt") {
      // Stop names this turn, not whatever else runs in the conversation.
      var asked = document.querySelector(".stop-form input[name=attempt]");
      if (asked) asked.value = payload.attempt || "";
    } else if (name === "delta") {
      out.textContent += payload.text || "";
    } else if (name === "tool_call") {
      answer.appendChild(toolNote(payload.name));
    } else if (name === "error") {
      answer.classList.add("error");
      out.textContent = "The turn failed: " + (payload.detail || payload.error || "error");
    } else if (name === "done") {
      answer.classList.add("done");
    }
  }

  // Why a message was not sent, in its answer's place. A session that ended gets a
  // link to sign in again; a page older than the last sign-in, advice to reload. Either
  // way the composer's message (``draft``: an edit or a retry keeps none) waits in this
  // tab's storage, to be put back when the chat opens again.
  function refused(out, response, said, draft) {
    var problem = null;
    if ((response.headers.get("Content-Type") || "").indexOf("application/json") === 0) {
      try { problem = JSON.parse(said); } catch (e) { problem = null; }
    }
    if (!problem || !problem.detail) {
      out.textContent = response.ok ? "Not sent: the server did not answer with the chat's stream." : said;
      return;
    }
    out.textContent = "Not sent: " + problem.detail + ". ";
    if (problem.login) {
      var link = document.createElement("a");
      link.href = problem.login;
      link.textContent = "Sign in again";
      out.appendChild(link);
    }
    if (problem.login || problem.error === "stale_page") keepDraft(draft);
  }
  var DRAFT = "arbor:draft:" + window.location.pathname;
  function keepDraft(text) {
    try { if (text) window.sessionStorage.setItem(DRAFT, text); } catch (e) { /* storage off */ }
  }
  document.addEventListener("DOMContentLoaded", function () {
    var box = document.querySelector("#composer textarea[name=text]");
    var draft = null;
    try { draft = window.sessionStorage.getItem(DRAFT); } catch (e) { return; }
    if (!box || draft === null) return;
    window.sessionStorage.removeItem(DRAFT);
    if (!box.value) box.value = draft;
  });

  async function stream(form) {
    var chat = document.getElementById("chat");
    var path = document.getElementById("path");
    if (!chat || !path || chat.classList.contains("streaming")) return;
    var body = new FormData(form);
    var text = form.elements.text ? form.elements.text.value : "";
    // The composer empties as the message goes up into the chat (and gets it back if
    // the message is refused).
    var composerText = form.id === "composer" ? form.elements.text : null;
    var sentImages = form.id === "composer" ? Array.prototype.slice.call(composerImages(form).files) : [];
    if (composerText) composerText.value = "";
    if (sentImages.length) setAttachments(form, []);
    // An edit or a regenerate replaces the message and everything after it.
    var cut = form.getAttribute("data-cut") && document.getElementById(form.getAttribute("data-cut"));
    while (cut) {
      var next = cut.nextElementSibling;
      cut.remove();
      cut = next;
    }
    var empty = path.querySelector(".empty");
    if (empty) empty.remove();
    if (text || sentImages.length) {
      var asked = bubble("user", text);
      sentImages.forEach(function (file) {
        var img = document.createElement("img");
        img.alt = file.name;
        img.className = "live-image";
        var reader = new FileReader();
        reader.onload = function () { img.src = reader.result; };
        reader.readAsDataURL(file);
        asked.insertBefore(img, asked.firstChild);
      });
      path.appendChild(asked);
    }
    var answer = bubble("assistant", "");
    answer.id = "live-answer";
    answer.setAttribute("aria-live", "polite");
    path.appendChild(answer);
    var out = answer.firstChild;
    chat.classList.add("streaming");
    var ok = false;
    try {
      var response = await fetch(form.action, {
        method: "POST",
        body: body,
        credentials: "same-origin",
        headers: { "X-CSRFToken": csrfToken(), Accept: "text/event-stream" },
      });
      var type = response.headers.get("Content-Type") || "";
      if (!response.ok || type.indexOf("text/event-stream") !== 0) {
        answer.classList.add("error");
        refused(out, response, await response.text(), composerText ? text : "");
        if (composerText && !composerText.value) composerText.value = text;
        if (sentImages.length && !composerImages(form).files.length) setAttachments(form, sentImages);
        return;
      }
      var reader = response.body.getReader();
      var decoder = new TextDecoder();
      var buffer = "";
      for (;;) {
        var chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        var at;
        while ((at = buffer.indexOf("\n\n")) >= 0) {
          handleEvent(buffer.slice(0, at), answer, out);
          buffer = buffer.slice(at + 2);
        }
      }
      ok = answer.classList.contains("done");
    } catch (e) {
      answer.classList.add("error");
      out.textContent += "\n[the connection was lost; reload to see what was saved]";
    } finally {
      chat.classList.remove("streaming");
      var stopButton = document.querySelector(".stop-form button");
      if (stopButton) { stopButton.disabled = false; stopButton.textContent = "Stop"; }
      // The saved turn, rendered (markdown, versions, actions), replaces the live text.
      if (ok) refreshChat();
    }
  }

  function showLive(answer, payload) {
    var out = answer.querySelector(".live-text");
    // The first event has the text so far; the next ones only what was added.
    if (out && typeof payload.append === "string") out.textContent += payload.append;
    else if (out) out.textContent = payload.text || "";
    Array.prototype.forEach.call(answer.querySelectorAll(".live-tool"), function (n) { n.remove(); });
    (payload.tools || []).forEach(function (name) { answer.appendChild(toolNote(name)); });
  }

  // A chat opened (or reloaded) while its turn runs in another request: follow what
  // that turn streams, then show the saved turn.
  var following = null;
  function follow() {
    var answer = document.getElementById("live-answer");
    var url = answer && answer.getAttribute("data-live-url");
    if (!url || !window.EventSource) return;
    // A chat redrawn mid-turn (a version switch) follows afresh: the new page's text
    // comes whole in the first event.
    if (following) following.close();
    var source = new EventSource(url);
    following = source;
    function end() {
      source.close();
      if (following === source) following = null;
      refreshChat();
    }
    source.addEventListener("live", function (event) {
      var shown = document.getElementById("live-answer");
      try { if (shown) showLive(shown, JSON.parse(event.data)); } catch (e) { /* a torn event: wait for the next */ }
    });
    source.addEventListener("done", end);
    source.addEventListener("error", function (event) {
      // The server's own "error" event carries data; the browser's (the connection
      // failed) has none and reconnects by itself, unless the stream is closed for good.
      if (event.data || source.readyState === EventSource.CLOSED) end();
    });
  }
  document.addEventListener("DOMContentLoaded", follow);

  // Code blocks get a Copy button (the page's script adds it: without JavaScript
  // there is nothing it could do).
  function addCopyButtons(root) {
    if (!root.querySelectorAll) return;
    Array.prototype.forEach.call(root.querySelectorAll(".md pre"), function (pre) {
      if (pre.parentNode.classList.contains("codeblock")) return;
      var box = document.createElement("div");
      box.className = "codeblock";
      pre.parentNode.insertBefore(box, pre);
      box.appendChild(pre);
      var button = document.createElement("button");
      button.type = "button";
      button.className = "copy";
      button.textContent = "Copy";
      button.setAttribute("aria-label", "Copy the code");
      box.appendChild(button);
    });
  }
  document.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest(".codeblock .copy") : null;
    if (!button) return;
    var code = button.parentNode.querySelector("pre").innerText;
    var done = function (word) {
      button.textContent = word;
      setTimeout(function () { button.textContent = "Copy"; }, 1500);
    };
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(code).then(function () { done("Copied"); }, function () { done("Copy failed"); });
    } else {
      done("Copy failed");
    }
  });
  document.addEventListener("DOMContentLoaded", function () { addCopyButtons(document); });
  document.addEventListener("htmx:load", function (event) { addCopyButtons(event.target); });
  document.addEventListener("htmx:load", function (event) {
    if (event.target && event.target.id !== "chat") return;
    if (document.getElementById("live-answer")) follow();
    else if (following) { following.close(); following = null; }
  });

  // Stop: the running turn keeps what streamed as a partial answer; its stream (or the
  // one following it) then ends and the chat shows the saved turn.
  async function stop(form) {
    var button = form.querySelector("button");
    if (button) { button.disabled = true; button.textContent = "Stopping…"; }
    try {
      var response = await fetch(form.action, {
        method: "POST",
        body: new FormData(form),
        credentials: "same-origin",
        headers: { "X-CSRFToken": csrfToken(), Accept: "application/json" },
      });
      if (!response.ok && button) {
        var body = await response.json().catch(function () { return {}; });
        if (body.login) {  // the session ended: sign in, keeping what is being typed
          var typed = document.querySelector("#composer textarea[name=text]");
          if (typed) keepDraft(typed.value);
          window.location.assign(body.login);
          return;
        }
        button.textContent = "Stop";
        button.disabled = false;
        button.title = body.detail || "Stop failed";
      }
    } catch (e) {
      if (button) { button.textContent = "Stop"; button.disabled = false; }
    }
  }

  // Images for the composer: chosen with the paperclip or pasted into the message, they
  // ride in its file input and show as thumbnails (data: URLs: the CSP allows no blob:).
  function composerImages(form) {
    return form.querySelector("input[name=images]");
  }
  function showAttachments(form) {
    var input = composerImages(form);
    var list = form.querySelector(".attachments");
    if (!input || !list) return;
    list.textContent = "";
    Array.prototype.forEach.call(input.files, function (file, index) {
      var item = document.createElement("li");
      var img = document.createElement("img");
      img.alt = file.name;
      var reader = new FileReader();
      reader.onload = function () { img.src = reader.result; };
      reader.readAsDataURL(file);
      var remove = document.createElement("button");
      remove.type = "button";
      remove.className = "remove";
      remove.textContent = "✕";
      remove.setAttribute("aria-label", "Remove " + file.name);
      remove.addEventListener("click", function () { dropAttachment(form, index); });
      item.appendChild(img);
      item.appendChild(remove);
      list.appendChild(item);
    });
    list.hidden = input.files.length === 0;
  }
  function setAttachments(form, files) {
    var input = composerImages(form);
    var transfer = new DataTransfer();
    files.forEach(function (file) { transfer.items.add(file); });
    input.files = transfer.files;
    showAttachments(form);
  }
  function dropAttachment(form, index) {
    var files = Array.prototype.slice.call(composerImages(form).files);
    files.splice(index, 1);
    setAttachments(form, files);
  }
  document.addEventListener("paste", function (event) {
    var form = event.target.closest ? event.target.closest("#composer") : null;
    if (!form || !event.clipboardData || !window.DataTransfer) return;
    // Office apps and some pages put a picture of the selection beside its text: text
    // pastes as text, and only an image without text is attached.
    if ((event.clipboardData.getData("text/plain") || "").trim()) return;
    var pasted = Array.prototype.filter.call(event.clipboardData.files || [], function (file) {
      return /^image\//.test(file.type);
    });
    if (!pasted.length) return;
    event.preventDefault();
    setAttachments(form, Array.prototype.slice.call(composerImages(form).files).concat(pasted));
  });
  document.addEventListener("change", function (event) {
    var form = event.target.closest ? event.target.closest("#composer") : null;
    if (form && event.target.name === "images") showAttachments(form);
  });

  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!(form instanceof HTMLFormElement)) return;
    if (form.hasAttribute("data-stream")) {
      event.preventDefault();
      stream(form);
    } else if (form.hasAttribute("data-stop")) {
      event.preventDefault();
      stop(form);
    }
  });

  document.addEventListener("keydown", function (event) {
    var target = event.target;
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && target.form && target.form.hasAttribute("data-stream")) {
      event.preventDefault();
      target.form.requestSubmit();
      return;
    }
    if (event.altKey || event.ctrlKey || event.metaKey) return;
    if (target.closest && target.closest("input, textarea, select, [contenteditable]")) return;
    var messages = Array.prototype.slice.call(document.querySelectorAll("#path > .msg[data-id]"));
    if (!messages.length) return;
    var current = document.activeElement && document.activeElement.closest ? document.activeElement.closest("#path > .msg") : null;
    var index = messages.indexOf(current);
    if (event.key === "j" || event.key === "k") {
      var to = event.key === "j" ? index + 1 : (index < 0 ? messages.length - 1 : index - 1);
      to = Math.max(0, Math.min(messages.length - 1, to));
      messages[to].focus();
      event.preventDefault();
    } else if ((event.key === "[" || event.key === "]") && !document.querySelector("#chat.streaming")) {
      // The selected message, else the last one that has other versions.
      var msg = current;
      if (!msg || !msg.querySelector(".siblings")) {
        var withSiblings = messages.filter(function (m) { return m.querySelector(".siblings"); });
        msg = withSiblings[withSiblings.length - 1];
      }
      if (!msg) return;
      var button = msg.querySelector(event.key === "[" ? ".sib-prev" : ".sib-next");
      if (button && !button.disabled) button.click();
      event.preventDefault();
    }
  });

  // After a version switch, keep the keyboard on the message that was switched.
  document.body && document.body.addEventListener("arbor:tip-moved", function (event) {
    var id = event.detail && event.detail.message;
    setTimeout(function () {
      var el = id && document.getElementById("msg-" + id);
      if (el) el.focus();
    }, 0);
  });

  // The tree graph: its box scrolls to the tip on load and after each redraw; after the
  // tip moved there, the keyboard stays on the (redrawn) tip.
  function showGraphTip(focus) {
    var box = document.querySelector("#tree-graph .graph-box");
    var tip = box && box.querySelector(".gnode.is-tip");
    if (!tip) return;
    var boxRect = box.getBoundingClientRect();
    var tipRect = tip.getBoundingClientRect();
    box.scrollTop += tipRect.top - boxRect.top - box.clientHeight / 2;
    if (focus) {
      var link = tip.querySelector("a");
      if (link) link.focus({ preventScroll: true });
    }
  }
  document.addEventListener("DOMContentLoaded", function () { showGraphTip(false); });
  // Opening a branch only adds rows below the one clicked, so the box keeps its scroll.
  var graphScroll = null;
  document.addEventListener("htmx:beforeRequest", function (event) {
    var box = document.querySelector("#tree-graph .graph-box");
    graphScroll = box && box.contains(event.target) && event.target.hasAttribute("hx-get") ? box.scrollTop : null;
  });
  document.addEventListener("htmx:load", function (event) {
    var id = event.target && event.target.id;
    var box = document.querySelector("#tree-graph .graph-box");
    if (id === "tree-graph" && box && graphScroll !== null) box.scrollTop = graphScroll;
    else if (id === "tree-view" || id === "tree-graph") showGraphTip(id === "tree-view");
    graphScroll = null;
  });

  // A filter form shows its validation errors: htmx leaves 4xx answers unswapped, so
  // swap a 400 (the form's errors) or a 429 (a limit, said in words) from inside
  // [data-swap-errors] like a 200.
  document.addEventListener("htmx:beforeSwap", function (event) {
    var elt = event.detail.requestConfig && event.detail.requestConfig.elt;
    var status = event.detail.xhr.status;
    if ((status === 400 || status === 429) && elt && elt.closest && elt.closest("[data-swap-errors]")) {
      event.detail.shouldSwap = true;
      event.detail.isError = false;
    }
  });
  // A chat opens at its latest message, and loads its history a chunk at a time as it
  // is scrolled up: the marker above the first message shown asks for the chunk before
  // it when it comes into view (only after the first scroll to the bottom, so opening
  // the page does not load every chunk at once).
  var earlierObserver = null;
  function watchEarlier(root) {
    if (!earlierObserver || !window.htmx) return;
    var markers = root.querySelectorAll ? root.querySelectorAll("[data-earlier]") : [];
    if (root.matches && root.matches("[data-earlier]")) markers = [root];
    Array.prototype.forEach.call(markers, function (marker) { earlierObserver.observe(marker); });
  }
  function openAtLatest() {
    var path = document.getElementById("path");
    if (!path) return;
    var navigation = window.performance && performance.getEntriesByType
      ? performance.getEntriesByType("navigation")[0] : null;
    // A search hit, an anchor, or Back to a page read before: the browser's place wins.
    var focused = /[?&]m=/.test(window.location.search) || window.location.hash ||
      (navigation && navigation.type === "back_forward");
    var last = path.querySelector("li.msg:last-of-type");
    // The page's end: the last message sits just above the composer, not behind it.
    if (!focused && last) window.scrollTo(0, document.documentElement.scrollHeight);
    if ("IntersectionObserver" in window) {
      earlierObserver = new IntersectionObserver(function (entries) {
        entries.forEach(function (entry) {
          if (!entry.isIntersecting) return;
          earlierObserver.unobserve(entry.target);
          window.htmx.trigger(entry.target, "arbor:more");
        });
      }, { rootMargin: "600px 0px 0px 0px" });
      window.setTimeout(function () { watchEarlier(document); }, 0);
    }
  }
  document.addEventListener("DOMContentLoaded", openAtLatest);
  document.addEventListener("htmx:load", function (event) { watchEarlier(event.target); });
  // Earlier messages arrive above the ones in view: keep those where the reader left
  // them (the browser's own scroll anchoring does nothing at the very top of a page).
  var kept = null;
  document.addEventListener("htmx:beforeSwap", function (event) {
    var marker = event.detail.target;
    if (!marker || !marker.hasAttribute || !marker.hasAttribute("data-earlier")) return;
    if (!event.detail.shouldSwap) return;  // an error answer: nothing arrives
    var below = marker.nextElementSibling;
    kept = below ? { element: below, top: below.getBoundingClientRect().top } : null;
  });
  document.addEventListener("htmx:afterRequest", function (event) {
    if (kept && event.detail && event.detail.failed) kept = null;
  });
  document.addEventListener("htmx:afterSwap", function () {
    if (!kept) return;
    window.scrollBy(0, kept.element.getBoundingClientRect().top - kept.top);
    kept = null;
  });
})();
