// One GET through the proxies of the environment (HTTP_PROXY, HTTPS_PROXY, NO_PROXY), as a
// Node worker that uses undici's EnvHttpProxyAgent. Prints the status and the X-Up header.
const { EnvHttpProxyAgent, setGlobalDispatcher, fetch } = require('undici');

setGlobalDispatcher(new EnvHttpProxyAgent());
fetch(process.env.TARGET)
  .then(async (r) => {
    await r.arrayBuffer();
    console.log(r.status, r.headers.get('x-up'));
  })
  .catch((e) => {
    console.error(String(e.cause || e));
    process.exit(1);
  });
