// Node: the module is instantiated synchronously at import, so `new Broker()` works at once.
// Node has no IndexedDB: `Broker.open` takes one in its options (fake-indexeddb, tests).
import { readFileSync } from "node:fs";
import { initSync } from "./dist/warren_wasm.js";

initSync({ module: readFileSync(new URL("./dist/warren_wasm_bg.wasm", import.meta.url)) });

export * from "./dist/warren_wasm.js";
export { Broker, StoreError } from "./persist.js";
// Same shape as the browser entry: `await init()` is a no-op here.
export async function init() {}
