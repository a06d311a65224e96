// Preloaded into componentize-js by scripts/repro-builds/measure.sh (a measurement, not part of
// idemhost): Math.random becomes a fixed sequence (componentize-js names its work directory with
// it), and the wizer step it spawns with its own environment gets LD_PRELOAD too.
import { syncBuiltinESMExports } from 'node:module';
import childProcess from 'node:child_process';
let s = 0x2545F4914F6CDD1Dn;
Math.random = () => { s ^= s << 13n; s &= 0xFFFFFFFFFFFFFFFFn; s ^= s >> 7n; s ^= s << 17n; s &= 0xFFFFFFFFFFFFFFFFn; return Number(s >> 11n) / 2 ** 53; };
const real = childProcess.spawnSync;
childProcess.spawnSync = (cmd, args, opts) => {
  if (opts && opts.env && process.env.LD_PRELOAD) opts = { ...opts, env: { ...opts.env, LD_PRELOAD: process.env.LD_PRELOAD } };
  return real(cmd, args, opts);
};
syncBuiltinESMExports();
