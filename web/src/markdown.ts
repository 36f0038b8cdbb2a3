// Model output as Markdown that can never run: raw HTML in the output is shown as text, links keep
// only http(s) and mailto targets (anything else, `javascript:` included, is shown as text), images
// are shown as links (nothing is fetched), and DOMPurify cleans the result as a second line of defence.

import DOMPurify from "dompurify";
import { Marked, type Tokens } from "marked";

const SAFE_LINK = /^(https?:|mailto:)/i;

function escapeHTML(text: string): string {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function safeHref(href: string): string | null {
  const trimmed = href.trim();
  return SAFE_LINK.test(trimmed) ? trimmed : null;
}

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    html(token: Tokens.HTML | Tokens.Tag): string {
      return escapeHTML(token.text);
    },
    link(token: Tokens.Link): string {
      const href = safeHref(token.href);
      const text = this.parser.parseInline(token.tokens);
      if (href === null) return escapeHTML(token.raw);
      return `<a href="${escapeHTML(href)}" rel="noopener noreferrer nofollow" target="_blank">${text}</a>`;
    },
    image(token: Tokens.Image): string {
      const href = safeHref(token.href);
      const label = escapeHTML(token.text || token.href);
      if (href === null) return escapeHTML(token.raw);
      return `<a href="${escapeHTML(href)}" rel="noopener noreferrer nofollow" target="_blank">[image: ${label}]</a>`;
    },
  },
});

const PURIFY = {
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "input", "button", "iframe"],
  FORBID_ATTR: ["style"],
  ADD_ATTR: ["target"],
};

/** `text` as sanitized HTML. */
export function renderMarkdown(text: string): string {
  const html = marked.parse(text, { async: false }) as string;
  return DOMPurify.sanitize(html, PURIFY) as unknown as string;
}
