#!/usr/bin/env bash
# Resolves the Kafka broker pinned by POM (tests/kafka/pom.xml) and its
# runtime dependencies into Maven's local repository, once per machine, and
# writes their classpath (jar paths joined by ':') to OUT. Offline first, so
# that a machine that has them never asks Maven Central again.
#
#   tests/kafka/classpath.sh POM OUT
set -euo pipefail
pom=$1 out=$2

missing=()
command -v java >/dev/null 2>&1 || missing+=("java (OpenJDK 17 or later: apt-get install openjdk-17-jre-headless)")
command -v mvn >/dev/null 2>&1 || missing+=("mvn (Maven 3: apt-get install maven)")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'outboxd: the real Kafka broker cannot be fetched, missing: %s (scripts/deps installs them)\n' \
    "${missing[*]}" >&2
  exit 1
fi
spec=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
if [ -z "$spec" ] || [ "${spec%%.*}" -lt 17 ]; then
  echo "outboxd: Kafka 4 needs Java 17 or later; $(command -v java) is ${spec:-of unknown version}" \
       "(apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi

mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
goal=(org.apache.maven.plugins:maven-dependency-plugin:3.8.1:build-classpath
      -DincludeScope=runtime -Dmdep.outputFile="$tmp" -Dmdep.pathSeparator=:)
if ! mvn -B -q -o -f "$pom" "${goal[@]}" >/dev/null 2>&1; then
  echo "outboxd: fetching the Kafka broker from Maven Central into Maven's local repository (once)" >&2
  mvn -B -q -f "$pom" "${goal[@]}" >&2
fi
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")
if ! tr ':' '\n' <"$tmp" | grep -q "/kafka_2.13-$version.jar\$"; then
  echo "outboxd: the classpath Maven wrote names no kafka_2.13-$version.jar" >&2
  exit 1
fi
mv "$tmp" "$out"
