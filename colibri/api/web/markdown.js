// Model output as markdown, built node by node. Safety rule: text from outside the page enters
// the DOM only as text nodes or textContent, never as markup; the few elements here are made by
// this module itself, and a link is made only for an absolute http(s) URL.

const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
// code, **bold**, *italic*, [text](url); the markers need a non-space inside, so "2 * 3 * 4" stays
const INLINE = new RegExp(
  [/`([^`\n]+)`/, /\*\*(\S(?:.*?\S)?)\*\*/, /\*([^\s*](?:[^*\n]*?[^\s*])?)\*/, /\[([^\]\n]+)\]\(([^()\s]+)\)/]
    .map((r) => r.source).join("|"),
);

/** Markdown text as a DocumentFragment: paragraphs, headings, lists, fenced code, `code`, **bold**,
 *  *italic* and http(s) links. Everything else, HTML included, stays literal text. */
export function renderMarkdown(text, doc = document) {
  const frag = doc.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  const flush = () => {
    if (para.length) frag.append(paragraph(para, doc));
    para = [];
  };
  for (let i = 0; i < lines.length; ) {
    const block = fenced(lines, i, doc) || heading(lines, i, doc) || list(lines, i, doc);
    if (block) {
      flush();
      frag.append(block.node);
      i = block.next;
      continue;
    }
    if (lines[i].trim()) para.push(lines[i]);
    else flush();
    i++;
  }
  flush();
  return frag;
}

function paragraph(lines, doc) {
  const p = doc.createElement("p");
  lines.forEach((line, k) => {
    if (k) p.append(doc.createElement("br")); // the model's line breaks are meant
    appendInline(p, line, doc);
  });
  return p;
}

// A block at line ``i``: ``{node, next}`` (``next``, the line after it), or null if none starts there.

function fenced(lines, i, doc) {
  const fence = FENCE.exec(lines[i]);
  if (!fence) return null;
  const body = [];
  let k = i + 1;
  for (; k < lines.length && !lines[k].trim().startsWith(fence[1]); k++) body.push(lines[k]);
  const pre = doc.createElement("pre");
  const code = doc.createElement("code");
  if (fence[2]) code.setAttribute("data-lang", fence[2]);
  code.textContent = body.join("\n");
  pre.append(code);
  return { node: pre, next: k + 1 }; // past the closing fence; a block still streaming shows as code so far
}

function heading(lines, i, doc) {
  const m = HEADING.exec(lines[i]);
  if (!m) return null;
  const h = doc.createElement(`h${Math.min(5, m[1].length + 2)}`); // below the page's own headings
  appendInline(h, m[2], doc);
  return { node: h, next: i + 1 };
}

function list(lines, i, doc) {
  const first = LIST_ITEM.exec(lines[i]);
  if (!first) return null;
  const ordered = /\d/.test(first[1]);
  const node = doc.createElement(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[1], 10) !== 1) node.setAttribute("start", String(parseInt(first[1], 10)));
  let k = i;
  while (k < lines.length) {
    const m = LIST_ITEM.exec(lines[k]);
    if (!m || /\d/.test(m[1]) !== ordered) break;
    const li = doc.createElement("li");
    appendInline(li, m[2], doc);
    node.append(li);
    // an indented line that is not an item continues the item
    for (k++; k < lines.length && /^\s{2,}\S/.test(lines[k]) && !LIST_ITEM.test(lines[k]); k++) {
      li.append(doc.createElement("br"));
      appendInline(li, lines[k].trim(), doc);
    }
  }
  return { node, next: k };
}

function appendInline(parent, text, doc) {
  const re = new RegExp(INLINE, "g");
  let last = 0;
  for (let m; (m = re.exec(text)); last = re.lastIndex) {
    if (m.index > last) parent.append(doc.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) {
      const code = doc.createElement("code");
      code.textContent = m[1];
      parent.append(code);
    } else if (m[2] !== undefined || m[3] !== undefined) {
      const node = doc.createElement(m[2] !== undefined ? "strong" : "em");
      appendInline(node, m[2] ?? m[3], doc);
      parent.append(node);
    } else {
      parent.append(link(m[4], m[5], m[0], doc));
    }
  }
  if (last < text.length) parent.append(doc.createTextNode(text.slice(last)));
}

function link(label, href, source, doc) {
  let url = null;
  try {
    url = new URL(href); // absolute URLs only: a relative one would point into this server
  } catch {
    url = null;
  }
  if (!url || (url.protocol !== "http:" && url.protocol !== "https:")) {
    return doc.createTextNode(source); // javascript:, data:, … stay the text they were
  }
  const a = doc.createElement("a");
  a.setAttribute("href", url.href);
  a.setAttribute("rel", "noopener noreferrer");
  a.setAttribute("target", "_blank");
  a.textContent = label;
  return a;
}
