// Browsers and bundlers: `await init()` once (it fetches dist/warren_wasm_bg.wasm next to
// this file), then `new Broker()` (in memory) or `await Broker.open({ persist: "indexeddb" })`.
export * from "./dist/warren_wasm.js";
export { default as init } from "./dist/warren_wasm.js";
// The broker class with `open` (persist.js) in place of the generated one.
export { Broker, StoreError } from "./persist.js";
