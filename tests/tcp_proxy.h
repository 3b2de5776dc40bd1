/*
 * A small TCP proxy in front of each broker's client listener, so that tests
 * can cut the network between the relay and the brokers without root (no
 * iptables, no network namespaces). obx-kafka-cluster advertises the proxy's
 * ports to clients; the brokers talk to each other on a listener of their
 * own that no proxy is in front of, so a cut separates clients from the
 * cluster and never the brokers from each other.
 *
 * One thread forwards every connection. Each listener is in one mode:
 *
 *   open       bytes flow both ways;
 *   cut        every connection is reset (RST) and new ones are reset as
 *              they arrive: what a client sees when a firewall rejects, or
 *              a host reboots;
 *   blackhole  connections stay up and new ones are accepted, but nothing
 *              is forwarded until the mode changes: a network partition
 *              that drops packets (the client times out; when it heals,
 *              what was queued flows, as TCP retransmits).
 */
#ifndef OBX_TESTS_TCP_PROXY_H
#define OBX_TESTS_TCP_PROXY_H

enum tp_mode { TP_OPEN, TP_CUT, TP_BLACKHOLE };

#define TP_MAX_LISTENERS 8

/* Starts the thread with n listeners: listener i accepts on 127.0.0.1 at
 * listen_ports[i] and connects each client to 127.0.0.1:target_ports[i].
 * Returns 0, or -1 with errno set (nothing started). */
int tp_start(int n, const int *listen_ports, const int *target_ports);

/* Sets the mode of listener i (-1 = all) and applies it to its open
 * connections before returning. */
void tp_set_mode(int i, enum tp_mode mode);

/* Connections forwarded so far, of every listener (a test's sanity check). */
unsigned long tp_connections(void);

/* Stops the thread and closes every socket. */
void tp_stop(void);

#endif
