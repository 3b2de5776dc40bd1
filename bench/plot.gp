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
set yrange [0:*]
set xrange [0:*]
plot dir."/drain-mark.dat" using 1:2 with lines lw 2 lc rgb "#1f77b4" title "outboxd, mark", \
     (x * limit_mark < rows ? x * limit_mark : 1/0) with lines dt 2 lw 1.5 lc rgb "#1f77b4" \
       title sprintf("job's limit, mark (%.0fk rows/s)", limit_mark / 1000), \
     dir."/drain-delete.dat" using 1:2 with lines lw 2 lc rgb "#d62728" title "outboxd, delete", \
     (x * limit_delete < rows ? x * limit_delete : 1/0) with lines dt 2 lw 1.5 lc rgb "#d62728" \
       title sprintf("job's limit, delete (%.0fk rows/s)", limit_delete / 1000)

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
plot dir."/latency-100.dat" using 1:2 with lines lw 2 title "100 rows/s", \
     dir."/latency-1000.dat" using 1:2 with lines lw 2 title "1,000 rows/s", \
     dir."/latency-5000.dat" using 1:2 with lines lw 2 title "5,000 rows/s"
