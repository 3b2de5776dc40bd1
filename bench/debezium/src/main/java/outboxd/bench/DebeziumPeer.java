/*
 * The peer outboxd is measured against (issue 38): Debezium's PostgreSQL
 * connector (pgoutput, a slot and a publication of its own) with the Outbox
 * Event Router on outbox.events, on the embedded engine, each event produced
 * with an idempotent acks=all producer as the record outboxd makes of the
 * row (doc/contract.md): topic, key, the payload's bytes, an outbox-id
 * header, then one header per member of the row's headers in the byte order
 * of its name (strings verbatim, other values as jsonb prints them). The
 * engine's offsets (and the slot's confirmed position) move only after
 * Kafka acknowledged a batch.
 *
 *   java -cp CLASSPATH outboxd.bench.DebeziumPeer --host H --port P --user U
 *        --dbname D --bootstrap SERVERS --dir DIR [--password P] [--tuned]
 *        [--count N] [--note N]
 *
 * --dir holds the offsets file; --tuned sets the latency settings of
 * doc/performance.md (poll.interval.ms 10, larger batches, offsets flushed
 * each second, linger.ms 1) instead of Debezium's defaults; --count N stops after N
 * records were acknowledged; --note N prints "acked N" once N records were
 * acknowledged and streams on (the benchmark reads its CPU then). It prints
 * "ready" once streaming, "first" at the first record, and at the end the
 * records it produced; each with the seconds since the program started.
 */
package outboxd.bench;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.TreeMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringSerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;

public final class DebeziumPeer {
    /* Numbers as written (1.50 stays 1.50, as jsonb keeps it). */
    private static final ObjectMapper JSON = new ObjectMapper()
            .enable(com.fasterxml.jackson.databind.DeserializationFeature.USE_BIG_DECIMAL_FOR_FLOATS)
            .setNodeFactory(com.fasterxml.jackson.databind.node.JsonNodeFactory.withExactBigDecimals(true));
    private static final String PUBLICATION = "dbz_outbox_pub";

    /* The publication of outbox.events, made here once: outbox.events is
     * partitioned (sql/007), and only publish_via_partition_root names its
     * rows' changes after it rather than after each partition; inserts are
     * all the router uses. (Debezium's own "filtered" mode lists the
     * partitions, and with skipped.operations its ALTER fails on WITH.) */
    private static void publication(Map<String, String> a) throws java.sql.SQLException {
        String url = "jdbc:postgresql://" + need(a, "host") + ":" + need(a, "port") + "/"
                + need(a, "dbname");
        try (java.sql.Connection c = java.sql.DriverManager.getConnection(
                     url, need(a, "user"), a.getOrDefault("password", ""));
             java.sql.Statement st = c.createStatement()) {
            try (java.sql.ResultSet rs = st.executeQuery(
                         "SELECT 1 FROM pg_publication WHERE pubname = '" + PUBLICATION + "'")) {
                if (rs.next())
                    return;
            }
            st.execute("CREATE PUBLICATION " + PUBLICATION + " FOR TABLE outbox.events"
                    + " WITH (publish = 'insert', publish_via_partition_root = true)");
        }
    }

    public static void main(String[] argv) throws Exception {
        Map<String, String> a = options(argv);
        long count = Long.parseLong(a.getOrDefault("count", "0"));
        long note = Long.parseLong(a.getOrDefault("note", "0"));
        boolean tuned = a.containsKey("tuned");

        Properties p = new Properties();
        p.setProperty("name", "outbox-dbz");
        p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.FileOffsetBackingStore");
        p.setProperty("offset.storage.file.filename", need(a, "dir") + "/offsets.dat");
        p.setProperty("database.hostname", need(a, "host"));
        p.setProperty("database.port", need(a, "port"));
        p.setProperty("database.user", need(a, "user"));
        p.setProperty("database.password", a.getOrDefault("password", ""));
        p.setProperty("database.dbname", need(a, "dbname"));
        p.setProperty("topic.prefix", "dbz");
        p.setProperty("plugin.name", "pgoutput");
        p.setProperty("slot.name", a.getOrDefault("slot", "dbz_outbox"));
        p.setProperty("publication.name", PUBLICATION);
        p.setProperty("publication.autocreate.mode", "disabled"); /* ours: publication() */
        p.setProperty("table.include.list", "outbox\\.events");
        p.setProperty("snapshot.mode", "no_data");
        p.setProperty("tombstones.on.delete", "false");
        p.setProperty("binary.handling.mode", "bytes");
        p.setProperty("transforms", "outbox");
        p.setProperty("transforms.outbox.type", "io.debezium.transforms.outbox.EventRouter");
        p.setProperty("transforms.outbox.table.field.event.id", "id");
        p.setProperty("transforms.outbox.table.field.event.key", "key");
        p.setProperty("transforms.outbox.table.field.event.payload", "payload");
        p.setProperty("transforms.outbox.route.by.field", "topic");
        p.setProperty("transforms.outbox.route.topic.replacement", "${routedByValue}");
        p.setProperty("transforms.outbox.table.fields.additional.placement", "headers:header:headers");
        if (tuned) {
            p.setProperty("poll.interval.ms", "10");
            p.setProperty("max.batch.size", "8192");
            p.setProperty("max.queue.size", "32768");
            p.setProperty("offset.flush.interval.ms", "1000");
            p.setProperty("skipped.operations", "u,d,t");
        }

        publication(a);

        Properties k = new Properties();
        k.setProperty("bootstrap.servers", need(a, "bootstrap"));
        k.setProperty("acks", "all");
        k.setProperty("enable.idempotence", "true");
        k.setProperty("max.in.flight.requests.per.connection", "5");
        /* Kafka 4's default, 5 ms; tuned for latency, outboxd's 1 ms. */
        k.setProperty("linger.ms", tuned ? "1" : "5");
        k.setProperty("compression.type", "none");
        KafkaProducer<String, byte[]> producer =
                new KafkaProducer<>(k, new StringSerializer(), new ByteArraySerializer());

        AtomicLong produced = new AtomicLong();
        CountDownLatch done = new CountDownLatch(1);
        long started = System.nanoTime();
        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine =
                DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                        .using(p)
                        .using(new DebeziumEngine.ConnectorCallback() {
                            @Override
                            public void taskStarted() {
                                System.out.printf("ready %.3f s%n", (System.nanoTime() - started) / 1e9);
                                System.out.flush();
                            }
                        })
                        .notifying((records, committer) -> {
                            List<Future<RecordMetadata>> sent = new ArrayList<>(records.size());
                            for (RecordChangeEvent<SourceRecord> e : records) {
                                ProducerRecord<String, byte[]> r = toRecord(e.record());
                                sent.add(r == null ? null : producer.send(r));
                            }
                            for (int i = 0; i < records.size(); i++) {
                                if (sent.get(i) != null) {
                                    try {
                                        sent.get(i).get();
                                    } catch (Exception ex) {
                                        throw new RuntimeException("Kafka refused a record", ex);
                                    }
                                    if (produced.incrementAndGet() == 1) {
                                        System.out.printf("first %.3f s%n", (System.nanoTime() - started) / 1e9);
                                        System.out.flush();
                                    }
                                }
                                committer.markProcessed(records.get(i));
                            }
                            committer.markBatchFinished();
                            long before = produced.get() - sent.stream().filter(f -> f != null).count();
                            if (note > 0 && before < note && produced.get() >= note) {
                                System.out.printf("acked %d %.3f s%n", note, (System.nanoTime() - started) / 1e9);
                                System.out.flush();
                            }
                            if (count > 0 && produced.get() >= count)
                                done.countDown();
                        })
                        .using((success, message, error) -> {
                            if (!success)
                                System.err.println("debezium: " + message + (error != null ? ": " + error : ""));
                            done.countDown();
                        })
                        .build();
        /* On SIGTERM the JVM ends once its shutdown hooks return: this one
         * waits for the close below, which commits the offsets. */
        CountDownLatch closed = new CountDownLatch(1);
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            done.countDown();
            try {
                closed.await(60, TimeUnit.SECONDS);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }));
        ExecutorService runner = Executors.newSingleThreadExecutor();
        runner.execute(engine);
        done.await();
        try {
            engine.close(); /* commits the offsets of what was acknowledged */
        } finally {
            runner.shutdownNow();
            runner.awaitTermination(30, TimeUnit.SECONDS);
            producer.close();
            System.out.printf("produced %d%n", produced.get());
            System.out.flush();
            closed.countDown();
        }
    }

    /* The record outboxd makes of the row (doc/contract.md), or null for an
     * event that is not a row (a heartbeat). */
    static ProducerRecord<String, byte[]> toRecord(SourceRecord r) {
        Object id = null, members = null;
        for (Header h : r.headers()) {
            if (h.key().equals("id"))
                id = h.value();
            else if (h.key().equals("headers"))
                members = h.value();
        }
        if (id == null)
            return null;
        RecordHeaders headers = new RecordHeaders();
        headers.add("outbox-id", id.toString().getBytes(StandardCharsets.US_ASCII));
        if (members != null) {
            JsonNode o;
            try {
                o = JSON.readTree(members.toString());
            } catch (java.io.IOException e) {
                throw new IllegalStateException("row " + id + ": headers are not JSON", e);
            }
            TreeMap<byte[], String> names = new TreeMap<>(DebeziumPeer::compareBytes);
            for (Iterator<String> it = o.fieldNames(); it.hasNext(); ) {
                String n = it.next();
                names.put(n.getBytes(StandardCharsets.UTF_8), n);
            }
            for (String n : names.values()) {
                JsonNode v = o.get(n);
                String text = v.isTextual() ? v.textValue() : jsonb(v);
                headers.add(n, text.getBytes(StandardCharsets.UTF_8)); /* null: "null" */
            }
        }
        Object value = r.value();
        byte[] payload = value == null ? null
                : value instanceof ByteBuffer ? bytes((ByteBuffer) value) : (byte[]) value;
        return new ProducerRecord<>(r.topic(), null, (String) r.key(), payload, headers);
    }

    private static byte[] bytes(ByteBuffer b) {
        byte[] out = new byte[b.remaining()];
        b.duplicate().get(out);
        return out;
    }

    private static int compareBytes(byte[] x, byte[] y) {
        for (int i = 0; i < Math.min(x.length, y.length); i++) {
            int c = Integer.compare(x[i] & 0xff, y[i] & 0xff);
            if (c != 0)
                return c;
        }
        return Integer.compare(x.length, y.length);
    }

    /* A JSON value as PostgreSQL's jsonb prints it: ", " and ": " between
     * members, object keys shortest first, then by bytes. */
    static String jsonb(JsonNode v) {
        if (v.isObject()) {
            TreeMap<byte[], String> names = new TreeMap<>((x, y) -> x.length != y.length
                    ? Integer.compare(x.length, y.length) : compareBytes(x, y));
            for (Iterator<String> it = v.fieldNames(); it.hasNext(); ) {
                String n = it.next();
                names.put(n.getBytes(StandardCharsets.UTF_8), n);
            }
            StringBuilder s = new StringBuilder("{");
            for (String n : names.values()) {
                if (s.length() > 1)
                    s.append(", ");
                s.append(quote(n)).append(": ").append(jsonb(v.get(n)));
            }
            return s.append('}').toString();
        }
        if (v.isArray()) {
            StringBuilder s = new StringBuilder("[");
            for (JsonNode e : v) {
                if (s.length() > 1)
                    s.append(", ");
                s.append(jsonb(e));
            }
            return s.append(']').toString();
        }
        if (v.isTextual())
            return quote(v.textValue());
        if (v.isNumber())
            return v.decimalValue().toPlainString();
        return v.toString(); /* true, false, null */
    }

    private static String quote(String t) {
        StringBuilder s = new StringBuilder("\"");
        for (int i = 0; i < t.length(); i++) {
            char c = t.charAt(i);
            switch (c) {
            case '"': s.append("\\\""); break;
            case '\\': s.append("\\\\"); break;
            case '\b': s.append("\\b"); break;
            case '\f': s.append("\\f"); break;
            case '\n': s.append("\\n"); break;
            case '\r': s.append("\\r"); break;
            case '\t': s.append("\\t"); break;
            default:
                if (c < 0x20)
                    s.append(String.format("\\u%04x", (int) c));
                else
                    s.append(c);
            }
        }
        return s.append('"').toString();
    }

    private static Map<String, String> options(String[] argv) {
        Map<String, String> a = new HashMap<>();
        for (int i = 0; i < argv.length; i++) {
            if (!argv[i].startsWith("--"))
                throw new IllegalArgumentException("unexpected argument " + argv[i]);
            String name = argv[i].substring(2);
            if (name.equals("tuned"))
                a.put(name, "");
            else if (i + 1 < argv.length)
                a.put(name, argv[++i]);
            else
                throw new IllegalArgumentException("--" + name + " needs a value");
        }
        return a;
    }

    private static String need(Map<String, String> a, String name) {
        String v = a.get(name);
        if (v == null)
            throw new IllegalArgumentException("--" + name + " is required");
        return v;
    }
}
