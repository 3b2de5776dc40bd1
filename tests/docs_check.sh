#!/usr/bin/env bash
# The documents: generated ones must match what the code's tables and the
# diagram's source give now (a stale one names the command that rewrites it), the man pages must pass
# mandoc's lint, and `cmake --install` must put the binary and both pages
# where man finds them.
set -euo pipefail
src=$1 gen=$2 build=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stale=0
for pair in configuration:doc/configuration.md conf-man:doc/outboxd.conf.5; do
  what=${pair%%:*} file=${pair#*:}
  "$gen" "$what" >"$tmp/out"
  if ! cmp -s "$tmp/out" "$src/$file"; then
    echo "docs: $file is stale (the key table changed?); rewrite it with: cmake --build build --target docs"
    diff -u "$src/$file" "$tmp/out" | head -20 || true
    stale=1
  fi
done
dot -Tsvg "$src/doc/row-life.dot" -o "$tmp/row-life.svg"
if ! cmp -s "$tmp/row-life.svg" "$src/doc/row-life.svg"; then
  echo "docs: doc/row-life.svg is stale; rewrite it with: cmake --build build --target docs"
  stale=1
fi
mandoc -T lint -W warning "$src/doc/outboxd.1" "$src/doc/outboxd.conf.5"
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
for f in bin/outboxd share/man/man1/outboxd.1 share/man/man5/outboxd.conf.5; do
  [ -s "$tmp/prefix/$f" ] || { echo "docs: cmake --install did not install $f"; exit 1; }
done
# man finds the installed pages and renders them without complaint.
MANPATH="$tmp/prefix/share/man" man -w outboxd.conf >/dev/null
[ "$stale" = 0 ]
echo "docs: generated documents current, man pages lint-clean and installed"
