#!/usr/bin/env bash
# No Docker engine runs here: validate docker-compose.yml with
# `docker-compose config`, and check that the outboxd configuration the
# compose file mounts is one outboxd accepts, with the conninfo the compose
# file passes in the environment.
set -euo pipefail
src=$1 outboxd=$2
cd "$src"
docker-compose -f docker-compose.yml config -q
# Read once: awk leaving early must not cut the pipe under docker-compose.
cfg=$(docker-compose -f docker-compose.yml config)
conninfo=$(awk '/OUTBOXD_POSTGRES_CONNINFO:/ {sub(/^[^:]*: */, ""); print; exit}' <<<"$cfg")
[ -n "$conninfo" ] || { echo "compose: outboxd has no OUTBOXD_POSTGRES_CONNINFO"; exit 1; }
env -i PATH="$PATH" OUTBOXD_POSTGRES_CONNINFO="$conninfo" \
  "$outboxd" --config config/compose/outboxd.conf --check
# The schema files the postgres service mounts are the ones in sql/.
for f in sql/*.sql; do
  grep -q "./$f:/docker-entrypoint-initdb.d/" docker-compose.yml || { echo "compose does not apply $f"; exit 1; }
done
# outboxd's health check asks /readyz on the port its configuration serves.
port=$(awk -F'[: ]+' '/^http.listen/ {print $NF}' config/compose/outboxd.conf)
health=$(awk '/^  outboxd:/ {o=1} o && /healthcheck:/ {h=1} h && /\/readyz/ {print; exit}' <<<"$cfg")
[[ "$health" == *"/dev/tcp/127.0.0.1/$port"* && "$health" == *"GET /readyz"* ]] ||
  { echo "compose: outboxd's health check does not ask /readyz on port $port: $health"; exit 1; }
# Two relays share the slots: both run the same configuration, whose
# relay.shards is above 1 (with 1 the second would only stand by).
relays=$(grep -c '/etc/outboxd/outboxd.conf' <<<"$cfg" || true)
shards=$(awk -F'= *' '/^relay.shards/ {print $2+0}' config/compose/outboxd.conf)
[[ "$relays" -ge 2 && "${shards:-1}" -gt 1 ]] ||
  { echo "compose: expected two relays sharing slots, found $relays with relay.shards = ${shards:-1}"; exit 1; }
# Its Kafka is the one the real-kafka tests run (tests/kafka/pom.xml).
pinned=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' tests/kafka/pom.xml)
images=$(awk '/image: apache\/kafka:/ {sub(/.*apache\/kafka:/, ""); print}' <<<"$cfg" | sort -u)
[[ -n "$pinned" && "$images" == "$pinned" ]] ||
  { echo "compose: apache/kafka images are '$images', tests/kafka/pom.xml pins '$pinned'"; exit 1; }
echo "compose: valid"
