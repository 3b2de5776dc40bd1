# outboxd image: built on Debian 12, runs as a non-root user.
#   docker build -t outboxd .
FROM debian:12-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake pkg-config \
      libpq-dev librdkafka-dev libuv1-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY include include
COPY service service
COPY bench bench
COPY tests tests
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DOBX_TESTS=OFF \
 && cmake --build build -j"$(nproc)" --target outboxd \
 && strip build/outboxd

FROM debian:12-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libpq5 librdkafka1 libuv1 libssl3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin outboxd
COPY --from=build /src/build/outboxd /usr/local/bin/outboxd
COPY sql /usr/local/share/outboxd/sql
COPY config/outboxd.conf /usr/local/share/outboxd/outboxd.conf.example
USER 10001
# /livez, /readyz, /metrics (set http.listen = 0.0.0.0:9187 to reach them).
EXPOSE 9187
ENTRYPOINT ["/usr/local/bin/outboxd"]
CMD ["--config", "/etc/outboxd/outboxd.conf"]
