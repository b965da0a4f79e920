// A small Markdown renderer for model answers: fenced code blocks (also while their closing fence has not arrived),
// inline code, bold, italics, headings, lists, links and paragraphs. Everything is escaped first; no raw HTML.
"use strict";

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function renderInline(text) {
  return text.split(/(`[^`\n]+`)/g).map((part) => {
    if (part.length > 1 && part.startsWith("`") && part.endsWith("`")) {
      return "<code>" + escapeHtml(part.slice(1, -1)) + "</code>";
    }
    return escapeHtml(part)
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener">$1</a>');
  }).join("");
}

function renderMarkdown(source) {
  const lines = source.split("\n");
  const out = [];
  let paragraph = [];
  let list = null;
  const flushParagraph = () => {
    if (paragraph.length) out.push("<p>" + paragraph.map(renderInline).join("<br>") + "</p>");
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>` + list.items.map((i) => "<li>" + renderInline(i) + "</li>").join("") + `</${list.tag}>`);
    list = null;
  };
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
    if (fence) {
      flushParagraph();
      flushList();
      const code = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
      const open = i >= lines.length;  // still streaming: the closing fence has not come yet
      i += 1;
      const lang = escapeHtml(fence[2] || "code");
      out.push(`<div class="code${open ? " open" : ""}"><div class="code-head"><span>${lang}</span>` +
               `<button type="button" class="copy">copy</button></div><pre><code>${escapeHtml(code.join("\n"))}</code></pre></div>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      flushParagraph();
      flushList();
      const level = Math.min(6, heading[1].length + 2);
      out.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
    } else if (/^\s*$/.test(line)) {
      flushParagraph();
      flushList();
    } else {
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
      if (item) {
        flushParagraph();
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (!list || list.tag !== tag) {
          flushList();
          list = {tag, items: []};
        }
        list.items.push(item[2]);
      } else {
        flushList();
        paragraph.push(line);
      }
    }
    i += 1;
  }
  flushParagraph();
  flushList();
  return out.join("\n");
}
