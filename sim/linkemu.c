/* linkemu: the testbed's switch -- moves Ethernet frames between the switch-side veths of
 * the emulated hosts, holding each frame for the latency of the sender's and the
 * receiver's access links (plus jitter), dropping it with the links' loss probabilities
 * and across an active partition (or, for a one-way partition, the frames that carry data:
 * TCP's bare acknowledgements still pass, so transfers the other way keep flowing).
 *
 * Why a userspace forwarder: this kernel has no netem (and no fq for EDT delays), so delay
 * cannot be a qdisc.  Rates stay in the kernel (tbf on both veth ends, set up by
 * sim/testbed.py); this program only delays, drops and switches.
 *
 * Why PACKET_VNET_HDR: TCP on a veth sends GSO super-frames of up to 64 KiB.  With the
 * virtio-net header a packet socket receives them whole (with their checksum-offload
 * state) and can send them on whole, so a 1 Gbit/s flow is ~2k frames/s here instead of
 * ~85k.  Loss is per wire packet: a super-frame of s segments is dropped with probability
 * 1-(1-p)^s; the testbed turns GSO off on every link when any host has loss > 0, so that
 * losses are single segments, as on a real link.
 *
 * Switching: hosts have static neighbour entries, and host i's MAC is 02:7a:74:62:HH:LL with
 * HHLL = i, so the destination MAC names the output port; anything else is dropped.
 *
 * Usage: linkemu SEED IF0:LAT_US:JIT_US:LOSS IF1:... (one per host, in host order)
 * Control lines on stdin:  block I J | unblock I J | blockdata I J | unblockdata I J | heal |
 *                          link I LAT_US JIT_US LOSS | stats | quit   (EOF = quit).
 * Answers are JSON lines on stdout.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <math.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

#define MAXP 64
#define BUFSZ (256 * 1024)
#define VH ((int)sizeof(struct virtio_net_hdr))

typedef struct frame {
    struct frame *next;
    int64_t release_ns; /* when it may leave */
    int len;
    unsigned char data[];
} frame;

typedef struct {
    frame *head, *tail;
    int64_t last_release; /* keeps per-pair order under jitter */
    long queued;
} pairq;

typedef struct {
    int fd;
    char name[IFNAMSIZ];
    int64_t lat_ns, jit_ns;
    double loss;
    /* counters (frames, bytes, wire segments) */
    unsigned long long rx_frames, rx_bytes, rx_segs, tx_frames, tx_bytes;
    unsigned long long drop_loss, drop_part, drop_qdisc, drop_unknown;
} port;

static port P[MAXP];
static pairq Q[MAXP][MAXP];
static unsigned char blocked[MAXP][MAXP];
static unsigned char datablocked[MAXP][MAXP]; /* one-way partitions: frames with data, I to J */

/* Whether an Ethernet frame carries data: anything but a TCP segment without payload (a bare
 * ACK, SYN or FIN) over IPv4.  A one-way partition drops these from I to J, so J's transfers to I
 * are still acknowledged and flow, while I's to J stall -- a cut that TCP does not turn into a
 * two-way one (dropping I's acknowledgements would stall J's transfers too). */
static int carries_data(const unsigned char *eth, int len) {
    if (len < ETH_HLEN + 20 || eth[12] != 0x08 || eth[13] != 0x00) return eth[12] != 0x08 || eth[13] != 0x06;
    const unsigned char *ip = eth + ETH_HLEN;
    int ihl = (ip[0] & 0x0f) * 4, tot = (ip[2] << 8) | ip[3];
    if (ip[9] != 6 || ihl < 20 || len < ETH_HLEN + ihl + 20) return 1;
    int thl = (ip[ihl + 12] >> 4) * 4;
    if (tot == 0) tot = len - ETH_HLEN; /* a GSO frame past 64 KiB (BIG TCP) leaves tot_len 0 */
    return tot - ihl - thl > 0;
}
static int NP;
static uint64_t rng_s;
static unsigned long long late_n, late_max_ns;
static unsigned long long rx_stamped, rx_waited_n; /* frames with a kernel receive time; of them, read late */
static double rx_waited_sum_ns;                     /* total time frames sat in the socket before we read them */
static int realtime;                                /* running under SCHED_FIFO */
static double late_sum_ns;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t rnd64(void) { /* splitmix64: seeded, reproducible draws */
    uint64_t z = (rng_s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static double unif(void) { return (rnd64() >> 11) * (1.0 / 9007199254740992.0); }
static double normal(void) {
    double u = unif(), v = unif();
    if (u < 1e-300) u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(2 * M_PI * v);
}
/* the simulator's jitter: extra N(0, sd) delay clipped at 0 */
static int64_t jitter(int64_t sd) {
    if (sd <= 0) return 0;
    double x = normal() * (double)sd;
    return x > 0 ? (int64_t)x : 0;
}

static int open_port(const char *name) {
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
    if (fd < 0) { perror("socket"); exit(2); }
    int one = 1, big = 64 << 20;
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0) { perror("PACKET_VNET_HDR"); exit(2); }
    /* we only want what the host sent, not our own transmissions on this port */
    if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0) { perror("PACKET_IGNORE_OUTGOING"); exit(2); }
    /* frames waiting in the downlink tbf are charged to this socket: a small buffer would throttle
       the emulated link below its rate */
    setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big);
    /* the kernel's receive time of each frame: the delay starts when the frame reached the switch,
       not when this process got round to reading it (on a busy machine that can be milliseconds) */
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    struct sockaddr_ll sll = {0};
    sll.sll_family = AF_PACKET;
    sll.sll_protocol = htons(ETH_P_ALL);
    sll.sll_ifindex = (int)if_nametoindex(name);
    if (!sll.sll_ifindex) { fprintf(stderr, "no interface %s\n", name); exit(2); }
    if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0) { perror("bind"); exit(2); }
    return fd;
}

static int segments(const unsigned char *buf, int len) {
    const struct virtio_net_hdr *h = (const void *)buf;
    if (h->gso_type == VIRTIO_NET_HDR_GSO_NONE || h->gso_size == 0) return 1;
    int payload = len - VH - h->hdr_len;
    return payload > 0 ? (payload + h->gso_size - 1) / h->gso_size : 1;
}

static void on_frame(int src, unsigned char *buf, int len, int64_t now, int64_t arrived) {
    port *ps = &P[src];
    int segs = segments(buf, len);
    ps->rx_frames++;
    ps->rx_bytes += (unsigned long long)(len - VH);
    ps->rx_segs += (unsigned long long)segs;
    if (len < VH + ETH_HLEN) { ps->drop_unknown++; return; }
    const unsigned char *dst = buf + VH;
    int d = (dst[4] << 8) | dst[5];
    if (!(dst[0] == 0x02 && dst[1] == 0x7a && dst[2] == 0x74 && dst[3] == 0x62) || d >= NP || d == src) {
        ps->drop_unknown++; /* e.g. IPv6 multicast, broadcasts: the hosts need none of it */
        return;
    }
    if (blocked[src][d] || (datablocked[src][d] && carries_data(dst, len - VH))) { ps->drop_part++; return; }
    double keep = pow(1.0 - ps->loss, segs) * pow(1.0 - P[d].loss, segs);
    if (keep < 1.0 && unif() >= keep) { ps->drop_loss++; return; }
    pairq *q = &Q[src][d];
    (void)now;
    int64_t rel = arrived + ps->lat_ns + P[d].lat_ns + jitter(ps->jit_ns) + jitter(P[d].jit_ns);
    if (rel < q->last_release) rel = q->last_release;
    q->last_release = rel;
    frame *f = malloc(sizeof(frame) + (size_t)len);
    if (!f) { ps->drop_qdisc++; return; }
    f->next = NULL;
    f->release_ns = rel;
    f->len = len;
    memcpy(f->data, buf, (size_t)len);
    if (q->tail) q->tail->next = f; else q->head = f;
    q->tail = f;
    q->queued++;
}

/* send every due frame; returns the earliest pending release (or -1) and marks ports whose
   socket buffer is full (they are retried when writable) */
static int64_t flush(int64_t now, int *want_out) {
    int64_t next = -1;
    for (int d = 0; d < NP; d++) want_out[d] = 0;
    for (int s = 0; s < NP; s++)
        for (int d = 0; d < NP; d++) {
            pairq *q = &Q[s][d];
            while (q->head && q->head->release_ns <= now && !want_out[d]) {
                frame *f = q->head;
                ssize_t w = send(P[d].fd, f->data, (size_t)f->len, 0);
                if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) { want_out[d] = 1; break; }
                if (w < 0) P[d].drop_qdisc++; /* ENOBUFS: the downlink tbf queue is full (tail drop) */
                else {
                    P[d].tx_frames++;
                    P[d].tx_bytes += (unsigned long long)(f->len - VH);
                    int64_t late = now - f->release_ns;
                    late_n++;
                    late_sum_ns += (double)late;
                    if ((unsigned long long)late > late_max_ns) late_max_ns = (unsigned long long)late;
                }
                q->head = f->next;
                if (!q->head) q->tail = NULL;
                q->queued--;
                free(f);
            }
            if (q->head && !want_out[d] && (next < 0 || q->head->release_ns < next)) next = q->head->release_ns;
        }
    return next;
}

static void stats(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    printf("{\"cpu_seconds\": %.6f, \"late_frames\": %llu, \"late_mean_us\": %.3f, \"late_max_us\": %.3f, "
           "\"realtime\": %s, \"rx_stamped\": %llu, \"rx_wait_mean_us\": %.3f, \"ports\": [",
           cpu, late_n, late_n ? late_sum_ns / late_n / 1e3 : 0.0, late_max_ns / 1e3, realtime ? "true" : "false",
           rx_stamped, rx_waited_n ? rx_waited_sum_ns / rx_waited_n / 1e3 : 0.0);
    for (int i = 0; i < NP; i++) {
        long queued = 0;
        for (int d = 0; d < NP; d++) queued += Q[i][d].queued;
        printf("%s{\"if\": \"%s\", \"rx_frames\": %llu, \"rx_bytes\": %llu, \"rx_segments\": %llu, \"tx_frames\": %llu, "
               "\"tx_bytes\": %llu, \"drop_loss\": %llu, \"drop_partition\": %llu, \"drop_qdisc\": %llu, "
               "\"drop_unknown\": %llu, \"queued\": %ld}",
               i ? ", " : "", P[i].name, P[i].rx_frames, P[i].rx_bytes, P[i].rx_segs, P[i].tx_frames, P[i].tx_bytes,
               P[i].drop_loss, P[i].drop_part, P[i].drop_qdisc, P[i].drop_unknown, queued);
    }
    printf("]}\n");
    fflush(stdout);
}

/* one control line; returns 0 to quit */
static int control(char *line) {
    int i, j;
    long long lat, jit;
    double loss;
    if (sscanf(line, "block %d %d", &i, &j) == 2 && i >= 0 && j >= 0 && i < NP && j < NP) {
        blocked[i][j] = 1;
    } else if (sscanf(line, "unblock %d %d", &i, &j) == 2 && i >= 0 && j >= 0 && i < NP && j < NP) {
        blocked[i][j] = 0;
    } else if (sscanf(line, "blockdata %d %d", &i, &j) == 2 && i >= 0 && j >= 0 && i < NP && j < NP) {
        datablocked[i][j] = 1;
    } else if (sscanf(line, "unblockdata %d %d", &i, &j) == 2 && i >= 0 && j >= 0 && i < NP && j < NP) {
        datablocked[i][j] = 0;
    } else if (strncmp(line, "heal", 4) == 0) {
        memset(blocked, 0, sizeof blocked);
        memset(datablocked, 0, sizeof datablocked);
    } else if (sscanf(line, "link %d %lld %lld %lf", &i, &lat, &jit, &loss) == 4 && i >= 0 && i < NP) {
        P[i].lat_ns = lat * 1000;
        P[i].jit_ns = jit * 1000;
        P[i].loss = loss;
    } else if (strncmp(line, "stats", 5) == 0) {
        stats();
        return 1;
    } else if (strncmp(line, "quit", 4) == 0) {
        return 0;
    } else {
        printf("{\"error\": \"bad command\"}\n");
        fflush(stdout);
        return 1;
    }
    printf("{\"ok\": true}\n");
    fflush(stdout);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: linkemu SEED IF:LAT_US:JIT_US:LOSS ...\n"); return 2; }
    signal(SIGPIPE, SIG_IGN);
    rng_s = strtoull(argv[1], NULL, 10) * 0x2545F4914F6CDD1DULL + 1;
    NP = argc - 2;
    if (NP > MAXP) { fprintf(stderr, "at most %d ports\n", MAXP); return 2; }
    for (int i = 0; i < NP; i++) {
        long long lat = 0, jit = 0;
        double loss = 0;
        char name[IFNAMSIZ];
        if (sscanf(argv[i + 2], "%15[^:]:%lld:%lld:%lf", name, &lat, &jit, &loss) != 4) {
            fprintf(stderr, "bad port spec %s\n", argv[i + 2]);
            return 2;
        }
        memcpy(P[i].name, name, sizeof P[i].name);
        P[i].lat_ns = lat * 1000;
        P[i].jit_ns = jit * 1000;
        P[i].loss = loss;
        P[i].fd = open_port(name);
    }
    unsigned char *buf = malloc(BUFSZ);
    char line[512];
    size_t linelen = 0;
    struct pollfd pfd[MAXP + 1];
    int want_out[MAXP];
    /* a switch has its own hardware: here the forwarder preempts the emulated hosts' processes so
       that frames leave when due, not when the scheduler next runs us (LINKEMU_NO_RT=1 to compare) */
    const char *nort = getenv("LINKEMU_NO_RT");
    if (!(nort && *nort && strcmp(nort, "0"))) {
        struct sched_param sp = {.sched_priority = 10};
        realtime = sched_setscheduler(0, SCHED_FIFO, &sp) == 0;
    }
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    printf("{\"ready\": true, \"realtime\": %s}\n", realtime ? "true" : "false");
    fflush(stdout);
    for (;;) {
        int64_t now = now_ns();
        int64_t next = flush(now, want_out);
        for (int i = 0; i < NP; i++) {
            pfd[i].fd = P[i].fd;
            pfd[i].events = POLLIN | (want_out[i] ? POLLOUT : 0);
            pfd[i].revents = 0;
        }
        pfd[NP].fd = 0;
        pfd[NP].events = POLLIN;
        pfd[NP].revents = 0;
        struct timespec ts, *tsp = NULL;
        if (next >= 0) {
            int64_t wait = next - now_ns();
            if (wait < 0) wait = 0;
            ts.tv_sec = wait / 1000000000LL;
            ts.tv_nsec = wait % 1000000000LL;
            tsp = &ts;
        }
        int n = ppoll(pfd, (nfds_t)NP + 1, tsp, NULL);
        if (n < 0 && errno != EINTR) { perror("ppoll"); return 1; }
        if (n <= 0) continue;
        now = now_ns();
        struct timespec rts;
        clock_gettime(CLOCK_REALTIME, &rts);
        int64_t real_to_mono = now - ((int64_t)rts.tv_sec * 1000000000LL + rts.tv_nsec);
        for (int i = 0; i < NP; i++) {
            if (!(pfd[i].revents & POLLIN)) continue;
            /* drain a bounded batch per port so one busy port cannot starve the others */
            for (int k = 0; k < 64; k++) {
                struct iovec iov = {buf, BUFSZ};
                union { char b[CMSG_SPACE(sizeof(struct timespec))]; struct cmsghdr align; } cb;
                struct msghdr mh = {0};
                mh.msg_iov = &iov;
                mh.msg_iovlen = 1;
                mh.msg_control = cb.b;
                mh.msg_controllen = sizeof cb.b;
                ssize_t r = recvmsg(P[i].fd, &mh, 0);
                if (r < 0) break;
                int64_t arrived = now;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                        struct timespec rt;
                        memcpy(&rt, CMSG_DATA(c), sizeof rt);
                        int64_t a = (int64_t)rt.tv_sec * 1000000000LL + rt.tv_nsec + real_to_mono;
                        rx_stamped++;
                        /* never in the future, and never before the clock offset's own error could put it */
                        if (a < now && a > now - 1000000000LL) {
                            arrived = a;
                            rx_waited_n++;
                            rx_waited_sum_ns += (double)(now - a);
                        }
                    }
                on_frame(i, buf, (int)r, now, arrived);
            }
        }
        if (pfd[NP].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = read(0, line + linelen, sizeof line - 1 - linelen);
            if (r <= 0) break; /* controller went away: stop */
            linelen += (size_t)r;
            line[linelen] = 0;
            char *nl;
            while ((nl = strchr(line, '\n'))) {
                *nl = 0;
                if (!control(line)) { stats(); return 0; }
                size_t rest = linelen - (size_t)(nl + 1 - line);
                memmove(line, nl + 1, rest);
                linelen = rest;
                line[linelen] = 0;
            }
            if (linelen >= sizeof line - 1) linelen = 0; /* an over-long line: discard it */
        }
    }
    stats();
    return 0;
}
