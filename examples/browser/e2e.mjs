// End to end in headless Chromium (Debian's /usr/bin/chromium, driven by playwright-core):
// load the page, publish twice, check both subscribers got both messages, save a
// screenshot. `node e2e.mjs [screenshot.png]`; exits non-zero on failure.
import { chromium } from "playwright-core";
import { serve } from "./serve.mjs";

const shot = process.argv[2] ?? "browser-e2e.png";
const server = await serve(0);
const url = `http://127.0.0.1:${server.address().port}/`;
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  args: ["--no-sandbox"],
});
let failed = false;
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => m.type() === "error" && errors.push(m.text()));
  await page.goto(url);
  await page.waitForSelector("#publish:not([disabled])", { timeout: 10_000 });
  await page.click("#publish");
  await page.fill("#topic", "home/garage/temp");
  await page.fill("#payload", "12.0");
  await page.click("#publish");
  const want = ["home/kitchen/temp: 21.5", "home/garage/temp: 12.0"];
  const wantB = ["home.kitchen.temp: 21.5", "home.garage.temp: 12.0"];
  await page.waitForFunction((n) => document.querySelectorAll("#sub-b li").length >= n, 2, {
    timeout: 5_000,
  });
  const a = await page.$$eval("#sub-a li", (els) => els.map((e) => e.textContent));
  const b = await page.$$eval("#sub-b li", (els) => els.map((e) => e.textContent));
  await page.screenshot({ path: shot, fullPage: true });
  console.log("subscriber A:", a);
  console.log("subscriber B:", b);
  console.log("screenshot:", shot);
  if (JSON.stringify(a) !== JSON.stringify(want) || JSON.stringify(b) !== JSON.stringify(wantB)) {
    console.error("FAIL: expected A", want, "and B", wantB);
    failed = true;
  }
  if (errors.length) {
    console.error("FAIL: page errors", errors);
    failed = true;
  }
} finally {
  await browser.close();
  server.close();
}
process.exit(failed ? 1 : 0);
