// A small Markdown renderer for model replies.
// Safety rule: the whole text is HTML-escaped before any markup is added, so nothing the model
// writes can become a tag or attribute; the only markup is what this file produces itself.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Inline markup on one already-escaped line. Code spans are cut out first (into placeholders)
// so that `*` or `[` inside code is never read as emphasis or a link.
function inline(line) {
  // Code spans and links are cut out first (into placeholders) so that `*`, `_` or `[` inside
  // them is never read as emphasis: not in the code, not in a URL, not in the attributes.
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = line.replace(/`([^`]+)`/g, (_, code) => hold(`<code>${code}</code>`));
  // Only http(s) links: a "javascript:" URL would be a script. The URL is already escaped, and
  // the character class excludes spaces and quotes' escapes cannot close the attribute.
  s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, text, url) =>
    hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${text}</a>`)
  );
  s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/__([^_]+)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^\w_])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
  // (twice: a link's text may hold a code span)
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  return restore(restore(s));
}

const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,3})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;

export function renderMarkdown(text) {
  // NUL is the placeholders' mark: a model's own NUL must not be read as one
  const clean = String(text || "").replace(/\u0000/g, "");
  const lines = escapeHtml(clean).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = []; // lines of the paragraph being collected
  let list = null; // { tag: "ul" | "ol", items: [] }

  const flushPara = () => {
    if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  const flush = () => {
    flushPara();
    flushList();
  };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const code = [];
      i++;
      // An unclosed fence (a reply still streaming) runs to the end of the text.
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      if (i >= lines.length && code.length && code[code.length - 1] === "") code.pop();
      const cls = fence[1] ? ` class="language-${fence[1]}"` : "";
      out.push(`<pre><code${cls}>${code.join("\n")}</code></pre>`);
      continue;
    }
    if (!line.trim()) {
      flush();
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      flush();
      const n = heading[1].length;
      out.push(`<h${n}>${inline(heading[2])}</h${n}>`);
      continue;
    }
    const bullet = line.match(BULLET);
    const numbered = bullet ? null : line.match(NUMBERED);
    if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
      continue;
    }
    if (list && /^\s{2,}\S/.test(line)) {
      // An indented line continues the previous list item.
      list.items[list.items.length - 1] += " " + line.trim();
      continue;
    }
    flushList();
    para.push(line);
  }
  flush();
  return out.join("\n");
}
