// Cargo runner for wasm32-wasip1 test binaries: runs them under Node's WASI implementation.
// Used by `make test-wasm` through CARGO_TARGET_WASM32_WASIP1_RUNNER.
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import process from "node:process";

const [, , wasmPath, ...args] = process.argv;
const wasi = new WASI({
  version: "preview1",
  args: [wasmPath, ...args],
  env: process.env,
  returnOnExit: true,
});
const module = await WebAssembly.compile(await readFile(wasmPath));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
process.exitCode = wasi.start(instance);
