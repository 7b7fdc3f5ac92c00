// Drives pacegate's status page in headless Chromium, as an operator on a phone would, and
// prints what it found as JSON: every destination card before and after unlocking the
// locked one through its button (answering the token prompt), the store's health, any
// script error or request outside the admin listener. Also saves a screenshot.
//
//   node status_page.js ADMIN_URL SCREENSHOT_PATH TOKEN
const puppeteer = require('puppeteer-core');

const [admin, shot, token] = process.argv.slice(2);

const readCards = (page) =>
  page.$$eval('section.destination', (cards) =>
    cards.map((c) => {
      const field = (name) => c.querySelector(`[data-field="${name}"]`)?.textContent ?? null;
      return {
        name: c.dataset.destination,
        mode: c.dataset.mode,
        locked: c.dataset.locked === 'true',
        shadowBadge: c.querySelector('[data-field="shadow"]') !== null,
        rates: field('rates'),
        backoff: field('backoff'),
        pause: field('pause'),
        waiting: field('waiting'),
        oldest: field('oldest'),
        vendor: field('vendor'),
        challenges: field('challenges'),
        cache: field('cache'),
        lock: field('lock'),
        unlockButton: c.querySelector('button.unlock') !== null,
        sparklineSamples: Number(c.querySelector('svg.spark')?.dataset.samples ?? -1),
        classes: [...c.querySelectorAll('tr[data-class]')].map((r) => r.dataset.class),
      };
    }),
  );

(async () => {
  const browser = await puppeteer.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
  });
  const found = { errors: [], outside: [], prompts: [] };
  try {
    const page = await browser.newPage();
    // A phone: 390 CSS pixels wide.
    await page.setViewport({ width: 390, height: 844, isMobile: true, hasTouch: true, deviceScaleFactor: 2 });
    page.on('pageerror', (e) => found.errors.push(String(e)));
    page.on('request', (r) => {
      if (!r.url().startsWith(admin)) found.outside.push(r.url());
    });
    page.on('dialog', async (d) => {
      found.prompts.push(d.message());
      await d.accept(token);
    });
    const response = await page.goto(`${admin}/`, { waitUntil: 'networkidle0' });
    found.contentType = response.headers()['content-type'];
    found.csp = response.headers()['content-security-policy'];
    await page.waitForSelector('body[data-ready="true"]', { timeout: 15000 });
    found.before = await readCards(page);
    found.store = await page.$eval('#store-health', (e) => e.textContent);
    found.overflowsPhone = await page.evaluate(() => document.documentElement.scrollWidth > window.innerWidth);
    await page.screenshot({ path: shot, fullPage: true });
    await page.click('section[data-destination="locked"] button.unlock');
    await page.waitForFunction(
      () => document.querySelector('section[data-destination="locked"]')?.dataset.locked === 'false',
      { timeout: 15000 },
    );
    found.message = await page.$eval('#message', (e) => e.textContent);
    found.after = await readCards(page);
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(found));
})().catch((e) => {
  console.error(String(e));
  process.exit(1);
});
