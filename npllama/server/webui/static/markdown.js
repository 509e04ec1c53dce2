// A model's answer as Markdown, made safe: marked renders it, with any raw HTML in the answer
// shown as text and images shown as links (the page loads nothing the model names), then
// DOMPurify removes whatever could still run script (javascript: links, event attributes).
// The page's Content-Security-Policy is the last line: no inline script, nothing off-origin.
import { Marked } from "./vendor/marked-18.3.0.esm.js";
import DOMPurify from "./vendor/purify-3.5.0.es.mjs";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

const marked = new Marked({
  gfm: true,
  renderer: {
    html: ({ text }) => escapeHtml(text),
    image: ({ href, text }) => `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`,
  },
});

const PURIFY = {
  FORBID_TAGS: ["style", "img", "form", "svg", "math"],
  FORBID_ATTR: ["style"],
  ALLOW_DATA_ATTR: false,
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Markdown `text` as a sanitised DocumentFragment. */
export function toFragment(text) {
  return DOMPurify.sanitize(marked.parse(text), PURIFY);
}

/** Replace `el`'s children with `text` rendered, each code block given a copy button. */
export function render(el, text) {
  el.replaceChildren(toFragment(text));
  for (const pre of el.querySelectorAll("pre")) {
    const box = document.createElement("div");
    box.className = "codeblock";
    pre.replaceWith(box);
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy code");
    button.addEventListener("click", () => copy(pre.textContent, button));
    box.append(button, pre);
  }
}

async function copy(text, button) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
    } else {  // plain http on another host: the old way, through a selection
      const area = document.createElement("textarea");
      area.value = text;
      area.setAttribute("readonly", "");
      area.className = "visually-hidden";
      document.body.append(area);
      area.select();
      const ok = document.execCommand("copy");
      area.remove();
      if (!ok) throw new Error("copy refused");
    }
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}
