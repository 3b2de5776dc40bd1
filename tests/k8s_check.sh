#!/usr/bin/env bash
# No Kubernetes cluster runs here: lint config/kubernetes/outboxd.yaml with
# yamllint, check what it promises against outboxd itself (the ConfigMap's
# configuration passes `outboxd --check`, the probes ask /livez and /readyz
# on the port it serves, the grace period outlasts shutdown.timeout, two
# relays or more share slots, the disruption budget keeps one), and check
# its PrometheusRule: the same rules as config/prometheus/outboxd-alerts.yml,
# which `promtool check rules` accepts.
set -euo pipefail
src=$1 outboxd=$2 promtool=$3
manifest=$src/config/kubernetes/outboxd.yaml
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
yamllint -d '{extends: default, rules: {line-length: {max: 250}, document-start: disable, comments: {min-spaces-from-content: 1}}}' "$manifest"
python3 - "$manifest" "$src/config/prometheus/outboxd-alerts.yml" "$tmp" "$src/Dockerfile" <<'PY'
import sys, yaml
manifest, alerts_path, tmp = sys.argv[1:4]
def fail(msg):
    sys.exit("k8s: " + msg)
docs = {}
for d in yaml.safe_load_all(open(manifest)):
    if d["kind"] in docs:
        fail("two documents of kind " + d["kind"])
    docs[d["kind"]] = d
for kind in ("ConfigMap", "Deployment", "PodDisruptionBudget", "PodMonitor", "PrometheusRule"):
    if kind not in docs:
        fail("no " + kind)
conf = docs["ConfigMap"]["data"]["outboxd.conf"]
open(tmp + "/outboxd.conf", "w").write(conf)
settings = dict(l.split("=", 1) for l in conf.splitlines() if "=" in l and not l.startswith("#"))
settings = {k.strip(): v.strip() for k, v in settings.items()}
port = int(settings["http.listen"].rsplit(":", 1)[1])
dep = docs["Deployment"]["spec"]
if dep["replicas"] < 2 or int(settings.get("relay.shards", "1")) < 2:
    fail("expected two relays or more sharing slots (replicas %s, relay.shards %s)"
         % (dep["replicas"], settings.get("relay.shards", "1")))
pod = dep["template"]["spec"]
c = pod["containers"][0]
ports = {p["name"]: p["containerPort"] for p in c["ports"]}
for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
    g = c[probe]["httpGet"]
    if g["path"] != path or ports.get(g["port"], g["port"]) != port:
        fail("%s asks %s on %s, outboxd serves %s on %d" % (probe, g["path"], g["port"], path, port))
mount = c["volumeMounts"][0]
volume = [v for v in pod["volumes"] if v["name"] == mount["name"]]
if c["args"][:2] != ["--config", "/etc/outboxd/outboxd.conf"] or \
        mount["mountPath"] != "/etc/outboxd" or not volume or \
        volume[0]["configMap"]["name"] != docs["ConfigMap"]["metadata"]["name"]:
    fail("the container does not read the ConfigMap's outboxd.conf")
import re
users = re.findall(r"^USER\s+(\S+)", open(sys.argv[4]).read(), re.M)
if not users:
    fail("the Dockerfile names no USER")
uid = users[-1]
if str(pod["securityContext"].get("runAsUser")) != uid:
    fail("runAsUser is not the image's user (Dockerfile: USER %s)" % uid)
if docs["PodMonitor"]["spec"].get("jobLabel") != "app.kubernetes.io/name" or \
        dep["template"]["metadata"]["labels"].get("app.kubernetes.io/name") != "outboxd":
    fail('the PodMonitor does not name the job "outboxd", which the alert rules select')
timeout = settings.get("shutdown.timeout", "30s")
secs = int(timeout[:-1]) * {"s": 1, "m": 60}[timeout[-1]]
if pod["terminationGracePeriodSeconds"] <= secs:
    fail("terminationGracePeriodSeconds must outlast shutdown.timeout (%s)" % timeout)

labels = dep["template"]["metadata"]["labels"]
for kind in ("PodDisruptionBudget", "PodMonitor"):
    sel = docs[kind]["spec"]["selector"]["matchLabels"]
    if any(labels.get(k) != v for k, v in sel.items()):
        fail(kind + " does not select the relays' pods")
if docs["PodDisruptionBudget"]["spec"].get("minAvailable", 0) < 1:
    fail("the disruption budget keeps no relay")
rules = {"groups": docs["PrometheusRule"]["spec"]["groups"]}
if rules != yaml.safe_load(open(alerts_path)):
    fail("the PrometheusRule differs from config/prometheus/outboxd-alerts.yml")
yaml.safe_dump(rules, open(tmp + "/rules.yml", "w"))
PY
env -i PATH="$PATH" OUTBOXD_POSTGRES_CONNINFO="host=db dbname=app user=outboxd_relay" \
  "$outboxd" --config "$tmp/outboxd.conf" --check
"$promtool" check rules "$tmp/rules.yml" >/dev/null
echo "k8s: valid"
