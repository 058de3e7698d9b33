// A static server for the example, on loopback only: / is this folder, /pkg/ the npm
// package (wasm/js, after scripts/build-js.sh). `node serve.mjs [port]`; prints the URL.
import { createServer } from "node:http";
import { readFile } from "node:fs/promises";
import { extname, join, normalize, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";

const here = resolve(fileURLToPath(new URL(".", import.meta.url)));
const roots = [
  ["/pkg/", resolve(here, "../../wasm/js")],
  ["/", here],
];
const types = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript",
  ".mjs": "text/javascript",
  ".wasm": "application/wasm",
  ".ts": "text/plain",
};

export function serve(port = 0) {
  const server = createServer(async (req, res) => {
    const path = decodeURIComponent(new URL(req.url, "http://x").pathname);
    const [prefix, dir] = roots.find(([p]) => path.startsWith(p));
    const rel = normalize(path.slice(prefix.length) || "index.html");
    const file = join(dir, rel);
    // No escaping the served folders, no node_modules.
    if (rel.startsWith("..") || !file.startsWith(dir + sep) || file.includes("node_modules")) {
      res.writeHead(403).end();
      return;
    }
    try {
      const body = await readFile(file);
      res.writeHead(200, { "content-type": types[extname(file)] ?? "application/octet-stream" });
      res.end(body);
    } catch {
      res.writeHead(404).end();
    }
  });
  return new Promise((resolve) => {
    server.listen(port, "127.0.0.1", () => resolve(server));
  });
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const server = await serve(Number(process.argv[2] ?? 8080));
  console.log(`http://127.0.0.1:${server.address().port}/`);
}
