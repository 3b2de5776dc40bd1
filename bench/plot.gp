# Draws bench/run's results from the files obx-bench writes with
# OBX_BENCH_PLOT=DIR (bench/run calls it):
#   gnuplot -e "dir='DIR'" bench/plot.gp  ->  DIR/drain.svg, DIR/latency.svg
if (!exists("dir")) dir = "."
set terminal svg size 900,480 dynamic font "Helvetica,12"
set key left top box opaque
set grid

# Drain: rows confirmed since the commit of the backlog, each mode beside a
# line at its job's limit (the minimal SELECT + UPDATE/DELETE pair, measured
# just before) starting at the same moment.
set output dir."/drain.svg"
stats dir."/drain-mark.dat" using 2 nooutput
rows = STATS_max
set title sprintf("Drain of a %.0f-row backlog against the job's limit", rows)
set xlabel "seconds since the backlog's commit"
set ylabel "rows confirmed"
set format y "%.0s%c"
limit_mark = real(system("cut -d' ' -f1 ".dir."/limit-mark.dat"))
limit_delete = real(system("cut -d' ' -f1 ".dir."/limit-delete.dat"))
# Log mode's job is the minimal keyset SELECT alone (no write).
limit_log = real(system("cut -d' ' -f1 ".dir."/limit-log.dat"))
set yrange [0:*]
set xrange [0:*]
plot dir."/drain-mark.dat" using 1:2 with lines lw 2 lc rgb "#1f77b4" title "outboxd, mark", \
     (x * limit_mark < rows ? x * limit_mark : 1/0) with lines dt 2 lw 1.5 lc rgb "#1f77b4" \
       title sprintf("job's limit, mark (%.0fk rows/s)", limit_mark / 1000), \
     dir."/drain-delete.dat" using 1:2 with lines lw 2 lc rgb "#d62728" title "outboxd, delete", \
     (x * limit_delete < rows ? x * limit_delete : 1/0) with lines dt 2 lw 1.5 lc rgb "#d62728" \
       title sprintf("job's limit, delete (%.0fk rows/s)", limit_delete / 1000), \
     dir."/drain-log.dat" using 1:2 with lines lw 2 lc rgb "#2ca02c" title "outboxd, log", \
     (x * limit_log < rows ? x * limit_log : 1/0) with lines dt 2 lw 1.5 lc rgb "#2ca02c" \
       title sprintf("job's limit, log: the SELECT alone (%.0fk rows/s)", limit_log / 1000)

# Latency: the distribution of commit -> record read by a consumer, per rate.
set output dir."/latency.svg"
set title "Latency from commit to consumer (mark mode)"
set xlabel "milliseconds"
set ylabel "fraction of records at or below"
set format y "%.1f"
set logscale x
set xrange [*:*]
set yrange [0:1]
set key right bottom
# At most about 1,000 points a line (the picture stays small), and every
# one of the slowest 1 %: the tail is what the picture is for.
step(f) = int((system("wc -l < ".f) + 0) / 1000) + 1
tail(f) = int((system("wc -l < ".f) + 0) * 0.99)
f1 = dir."/latency-100.dat"; s1 = step(f1); t1 = tail(f1)
f2 = dir."/latency-1000.dat"; s2 = step(f2); t2 = tail(f2)
f3 = dir."/latency-5000.dat"; s3 = step(f3); t3 = tail(f3)
plot f1 every s1::0::t1 using 1:2 with lines lw 2 lc 1 title "100 rows/s", \
     f1 every ::t1 using 1:2 with lines lw 2 lc 1 notitle, \
     f2 every s2::0::t2 using 1:2 with lines lw 2 lc 2 title "1,000 rows/s", \
     f2 every ::t2 using 1:2 with lines lw 2 lc 2 notitle, \
     f3 every s3::0::t3 using 1:2 with lines lw 2 lc 3 title "5,000 rows/s", \
     f3 every ::t3 using 1:2 with lines lw 2 lc 3 notitle
