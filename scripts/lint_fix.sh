#!/usr/bin/env bash
# The whole-tree lint pass (issue 36 brought ruff and mypy in on a tree written without them): ruff's safe fixes and
# the formatter over everything, then what is left for a person. Run it when nobody else is editing the tree (it
# rewrites most files), review `git diff`, then fix the rest by hand until .ci/run's two lint steps pass.
# Same tools and pins as CI: hatch's `lint` env (hatch.toml; settings in ruff.toml and mypy.ini).
set -uo pipefail
cd "$(dirname "$0")/.."
command -v hatch >/dev/null 2>&1 || python3 -m pip install -q hatch

# ruff check --fix, ruff format, and both again: a fix (an unused `# noqa` removed) can shorten a line the
# formatter then joins, and the formatter's wrapping can leave an import block to re-sort.
hatch run lint:fix -q

echo "== left for a person: ruff (by rule, then by file) =="
hatch run lint:ruff check --statistics .
hatch run lint:ruff check --output-format concise . | grep -oE '^[^:]+\.py' | sort | uniq -c | sort -rn | head -40
hatch run lint:ruff format --check . | tail -1
echo "== left for a person: mypy =="
hatch run lint:types | tail -1
# Rules that need a person (no safe fix): E501 (a string or comment the formatter cannot wrap: split the string, move
# the comment above), RUF059 (prefix the unused name with _), RUF043 (r"..." or re.escape for pytest.raises(match=)),
# E741 (rename `l`), B023 (bind the loop variable as a default argument, or say why the closure runs in this
# iteration), RUF005/RUF007/SIM108 (spelling), SIM115 (a `with`, or `# noqa: SIM115` where the handle outlives the
# statement), RUF012 (ClassVar), RUF006 (keep the task).
