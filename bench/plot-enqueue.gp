# bench/enqueue's picture: what the application's commits cost with
# outbox.enqueue, with the old enqueue that ended in a NOTIFY, and with a
# plain INSERT of the same row (median tps of the rounds, durable commits).
#   gnuplot -e "dir='DIR'; keys='300'" bench/plot-enqueue.gp -> DIR/enqueue.svg
if (!exists("dir")) dir = "."
if (!exists("keys")) keys = "?"
set terminal svg size 760,420 dynamic font "Helvetica,12"
set output dir."/enqueue.svg"
set title sprintf("The writer's cost: transactions/s with durable commits (%s keys)", keys)
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set ylabel "transactions/s (median of rounds)"
set xlabel "concurrent writers"
set yrange [0:*]
set grid ytics
set key left top
plot dir."/enqueue.dat" using 2:xtic(1) lc rgb "#1f77b4" title "outbox.enqueue", \
     '' using 3 lc rgb "#bbbbbb" title "old enqueue with NOTIFY", \
     '' using 4 lc rgb "#2ca02c" title "plain INSERT of the same row"
