// Browsers and bundlers: `await init()` once (it fetches dist/warren_wasm_bg.wasm next to
// this file), then `new Broker()`.
export * from "./dist/warren_wasm.js";
export { default as init } from "./dist/warren_wasm.js";
