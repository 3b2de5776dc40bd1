#!/usr/bin/env bash
# Builds the Debezium peer (bench/debezium) and writes its classpath to
# build-peer/classpath: Maven fetches Debezium 3.6.1.Final and what it needs
# from Maven Central into ~/.m2 (once per machine), compiles one class.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-../../build-peer}
mkdir -p "$out"
mvn -q -B -f pom.xml -DskipTests package dependency:copy-dependencies \
  -DoutputDirectory="$(realpath "$out")/lib" -DincludeScope=runtime
cp target/debezium-peer-1.jar "$out/"
echo "$(realpath "$out")/debezium-peer-1.jar:$(realpath "$out")/lib/*" >"$out/classpath"
