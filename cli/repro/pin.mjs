// Preloaded into componentize-js (node --import) by `idemhost plugin build` (cli/plugin_repro.rs),
// beside pin.c and tracer.c: componentize-js names its work directory with Math.random and keeps
// that name in the snapshot, so Math.random becomes a sequence from the project's seed
// (IDEMHOST_BUILD_SEED). The steps it spawns with an environment of their own keep LD_PRELOAD.
import { syncBuiltinESMExports } from 'node:module';
import childProcess from 'node:child_process';
let s = (BigInt('0x' + (process.env.IDEMHOST_BUILD_SEED || '0')) ^ 0x2545F4914F6CDD1Dn) || 1n;
Math.random = () => {
  s ^= s << 13n; s &= 0xFFFFFFFFFFFFFFFFn; s ^= s >> 7n; s ^= s << 17n; s &= 0xFFFFFFFFFFFFFFFFn;
  return Number(s >> 11n) / 2 ** 53;
};
const real = childProcess.spawnSync;
childProcess.spawnSync = (cmd, args, opts) => {
  if (opts && opts.env && process.env.LD_PRELOAD) {
    opts = { ...opts, env: { ...opts.env, LD_PRELOAD: process.env.LD_PRELOAD, IDEMHOST_BUILD_SEED: process.env.IDEMHOST_BUILD_SEED } };
  }
  return real(cmd, args, opts);
};
syncBuiltinESMExports();
