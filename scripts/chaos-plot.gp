# Draws a chaos run from the files obx-chaos writes with OBX_CHAOS_PLOT=DIR:
#   gnuplot -e "dir='DIR'" scripts/chaos-plot.gp      -> DIR/chaos.svg
# Top: each fault as a bar on its kind's line (schedules shaded in turn,
# those with findings in red); bottom: committed rows not yet published.
if (!exists("dir")) dir = "."
set terminal svg size 1400,700 dynamic font "Helvetica,11"
set output dir."/chaos.svg"
set multiplot layout 2,1 title "outboxd chaos: faults over time, and rows behind"
kinds = "kill9 stop terminate freeze-cut pg-restart-fast pg-restart-immediate pg-down brokers-down broker-down produce-errors reject-errors rtt sigterm sighup takeover slow-acks"
set lmargin 22
set rmargin 3
set xrange [0:*]
set ytics ("" 0)
do for [k=1:words(kinds)] { set ytics add (word(kinds, k) k-1) }
set yrange [-1:words(kinds)]
set grid xtics
unset xlabel
set style fill transparent solid 0.12 noborder
plot dir."/schedules.dat" using (($1+$2)/2):(words(kinds)/2.0-0.5):(($2-$1)/2):(words(kinds)/2.0+0.5) \
       with boxxyerror lc rgb "#4477aa" notitle, \
     dir."/schedules.dat" using (($1+$2)/2):(($4 > 0) ? words(kinds)/2.0-0.5 : 1/0):(($2-$1)/2):(words(kinds)/2.0+0.5) \
       with boxxyerror lc rgb "#dd2222" title "schedule with findings", \
     dir."/faults.dat" using 1:3:($2-$1):(0):($3+1) with vectors nohead lw 6 lc variable notitle
set ytics auto
set yrange [0:*]
set xlabel "seconds since the run started"
set ylabel "rows behind"
set lmargin 22
plot dir."/behind.dat" using 1:2 with lines lw 1 lc rgb "#227733" notitle
unset multiplot
