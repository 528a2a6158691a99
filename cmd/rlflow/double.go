package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/rlflow/rlflow/vllm/double"
	"github.com/spf13/cobra"
)

// doubleBanner is said in the help text and the startup log of every double.
const doubleBanner = "vLLM TEST AND DEMO DOUBLE: not an inference engine"

// doubleFlags are vllm-double's flags that shape each double's Config.
type doubleFlags struct {
	gen, apiKeyEnv, loadFormat string
	errorRate, dropRate        []string
	slowRate                   []string
	// backendSet: --backend was given. Unset, it is disk, or nccl on a
	// generation without the disk backend (A, B), so --generation A or B
	// alone makes a valid double.
	backendSet bool
	cfg        double.Config
}

// config is the doubles' Config from the flags (usage errors: exit 2);
// the double validates the values themselves.
func (f *doubleFlags) config() (double.Config, error) {
	cfg := f.cfg
	cfg.Generation = double.Generation(strings.ToUpper(f.gen))
	if !f.backendSet && !cfg.Generation.HasDiskBackend() {
		cfg.Backend = double.BackendNCCL
	}
	if cfg.Backend == double.BackendIPC {
		// Its handles would be files the server reads on a client's say
		// (the TEST DOUBLE's FileIPC): Go tests only, never a listener.
		return cfg, &exitError{code: 2, err: fmt.Errorf("--backend ipc: the double serves vLLM's ipc backend to Go tests only (vllm/double.FileIPC); use disk or nccl")}
	}
	cfg.LoadFormat = strings.ToLower(f.loadFormat)
	if f.apiKeyEnv != "" {
		if cfg.APIKey = os.Getenv(f.apiKeyEnv); cfg.APIKey == "" {
			return cfg, &exitError{code: 2, err: fmt.Errorf("--api-key-env: $%s is empty or unset", f.apiKeyEnv)}
		}
	}
	for _, ff := range []struct {
		flag string
		vals []string
		dst  *map[string]float64
	}{{"--error-rate", f.errorRate, &cfg.Faults.ErrorRate}, {"--drop-rate", f.dropRate, &cfg.Faults.DropRate}, {"--slow-rate", f.slowRate, &cfg.Faults.SlowRate}} {
		var err error
		if *ff.dst, err = parseRates(ff.flag, ff.vals); err != nil {
			return cfg, &exitError{code: 2, err: err}
		}
	}
	return cfg, nil
}

func newDoubleCmd() *cobra.Command { return doubleCmd(serveDoubles) }

// doubleCmd is vllm-double with serve doing the serving (tests capture it).
func doubleCmd(serve func(ctx context.Context, cfg double.Config, addrs []string) error) *cobra.Command {
	var listen []string
	var servers int
	var fl doubleFlags
	cmd := &cobra.Command{
		Use:   "vllm-double",
		Short: "Run the " + doubleBanner,
		Long: `vllm-double runs one or more vLLM TEST AND DEMO DOUBLES. A double is NOT an
inference engine: it speaks the HTTP contract of "vllm serve" with
VLLM_SERVER_DEV_MODE=1 (OpenAI completions and chat, pause/resume, the RLHF
weight-transfer routes of API generation A, B, C, D or E, /collective_rpc,
/server_info, /metrics, vLLM's status codes and payload validation) in front
of a character bigram table, so that rlflow's pipelines can be tried and
tested on machines without a GPU. New weights visibly change its samples.
Where the double and stock vLLM differ, stock vLLM is right.

Checkpoints reach a double in two ways:
  --backend nccl   stock vLLM. Its weight-transfer backend does the NCCL
                   rendezvous (no data plane in the double); a checkpoint
                   directory is reloaded through POST /collective_rpc
                   (reload_weights; with --load-format dummy, first
                   update_config to load format auto), as on stock vLLM.
  --backend disk   the draft disk backend of an unmerged vLLM pull request
                   (#52152), not in stock vLLM: update_weights takes a
                   checkpoint directory. /collective_rpc works here too.
                   Generations A and B have none: there --backend defaults
                   to nccl.
--load-format dummy starts with random weights (as vllm serve --load-format
dummy) and a reload_weights then redraws them until update_config sets the
load format to auto: the trap a client must avoid.

Each server has its own state. --listen is repeatable; --servers N serves N
doubles on consecutive ports starting at the (single) --listen address. It
binds loopback by default and stops on SIGINT or SIGTERM.

Fault flags take ROUTE=P (repeatable), P a probability in [0, 1] and ROUTE a
path such as /update_weights, or * for every route:
  rlflow vllm-double --error-rate /update_weights=1   # every update fails with 500`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			addrs, err := doubleAddrs(listen, servers)
			if err != nil {
				return &exitError{code: 2, err: err}
			}
			fl.backendSet = cmd.Flags().Changed("backend")
			cfg, err := fl.config()
			if err != nil {
				return err
			}
			return serve(cmd.Context(), cfg, addrs)
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&listen, "listen", []string{"127.0.0.1:8000"}, "host:port to serve on (repeatable: one double per address)")
	f.IntVar(&servers, "servers", 1, "number of doubles, on consecutive ports from --listen")
	f.StringVar(&fl.gen, "generation", string(double.GenD), "vLLM RLHF API generation: A, B, C, D or E (A: the early-2026 API of /init_weight_transfer and /finalize_weight_update; E: the newest, stock vLLM of December 2026)")
	f.StringVar(&fl.cfg.Backend, "backend", double.BackendDisk, "weight-transfer backend: disk (the draft of vLLM PR #52152, not stock; nccl is the default on A and B, which have no disk) or nccl (stock; rendezvous only, no data plane)")
	f.StringVar(&fl.loadFormat, "load-format", double.LoadFormatAuto, "vLLM's --load-format: auto (load --model) or dummy (random weights; reload_weights redraws them until update_config sets auto)")
	f.BoolVar(&fl.cfg.NoWeightChecker, "no-weight-checker", false, "serve no /weight_checker (as routers without it: 404)")
	f.BoolVar(&fl.cfg.DevMode, "dev-mode", true, "serve the RLHF routes, /collective_rpc and /server_info (as VLLM_SERVER_DEV_MODE=1 does)")
	f.StringVar(&fl.cfg.ModelPath, "model", "", "bigram safetensors checkpoint to serve (default: an untrained model from --seed)")
	f.StringVar(&fl.cfg.ModelName, "model-name", double.DefaultModelName, "served model name")
	f.Uint64Var(&fl.cfg.Seed, "seed", 0, "seed of the untrained model and the dummy weights, unseeded sampling and faults")
	f.DurationVar(&fl.cfg.Latency, "latency", 0, "time each sequence holds a slot (e.g. 50ms)")
	f.IntVar(&fl.cfg.MaxConcurrent, "slots", 0, "sequences served at once (0 = unlimited)")
	f.StringVar(&fl.apiKeyEnv, "api-key-env", "", "environment variable holding the API key required on /v1/* (vLLM's --api-key)")
	f.StringArrayVar(&fl.errorRate, "error-rate", nil, "ROUTE=P: answer HTTP 500 with probability P")
	f.StringArrayVar(&fl.dropRate, "drop-rate", nil, "ROUTE=P: close the connection without an answer with probability P")
	f.StringArrayVar(&fl.slowRate, "slow-rate", nil, "ROUTE=P: delay the route by --slow-by with probability P")
	f.DurationVar(&fl.cfg.Faults.SlowBy, "slow-by", time.Second, "delay of a slow fault")
	return cmd
}

// doubleAddrs expands --listen and --servers into one address per double.
func doubleAddrs(listen []string, servers int) ([]string, error) {
	switch {
	case servers < 1:
		return nil, fmt.Errorf("--servers %d: want at least 1", servers)
	case servers == 1:
		return listen, nil
	case len(listen) != 1:
		return nil, errors.New("--servers N takes one --listen address, the first of N consecutive ports")
	}
	host, port, err := net.SplitHostPort(listen[0])
	if err != nil {
		return nil, fmt.Errorf("--listen %q: %w", listen[0], err)
	}
	first, err := strconv.Atoi(port)
	if err != nil || first < 1 || first+servers-1 > 65535 {
		return nil, fmt.Errorf("--listen %q with --servers %d: want ports 1..65535", listen[0], servers)
	}
	out := make([]string, servers)
	for i := range out {
		out[i] = net.JoinHostPort(host, strconv.Itoa(first+i))
	}
	return out, nil
}

// parseRates reads ROUTE=P values; the double checks the range of P.
func parseRates(flag string, vals []string) (map[string]float64, error) {
	if len(vals) == 0 {
		return nil, nil
	}
	m := make(map[string]float64, len(vals))
	for _, s := range vals {
		route, p, ok := strings.Cut(s, "=")
		if !ok || (route != "*" && !strings.HasPrefix(route, "/")) {
			return nil, fmt.Errorf("%s %q: want ROUTE=P with ROUTE a path like /update_weights or *", flag, s)
		}
		v, err := strconv.ParseFloat(p, 64)
		if err != nil {
			return nil, fmt.Errorf("%s %q: P is not a number", flag, s)
		}
		m[route] = v
	}
	return m, nil
}

// doubles are vLLM test doubles serving in this process.
type doubles struct {
	urls   []string
	srvs   []*double.Server
	cancel context.CancelFunc
	errs   chan error // one Serve result per double
}

// startDoubles binds every address first (so a taken port fails before any
// double serves), then serves one double with cfg on each until ctx is
// done or stop is called. An address with port 0 gets a free port.
func startDoubles(ctx context.Context, cfg double.Config, addrs []string) (*doubles, error) {
	d := &doubles{errs: make(chan error, len(addrs))}
	var lns []net.Listener
	fail := func(err error) (*doubles, error) {
		for _, ln := range lns {
			ln.Close()
		}
		for _, s := range d.srvs {
			s.Close()
		}
		return nil, err
	}
	for _, a := range addrs {
		s, err := double.New(cfg)
		if err != nil {
			return fail(err)
		}
		d.srvs = append(d.srvs, s)
		ln, err := net.Listen("tcp", a)
		if err != nil {
			return fail(fmt.Errorf("vllm-double: %w", err))
		}
		lns = append(lns, ln)
		d.urls = append(d.urls, "http://"+ln.Addr().String())
	}
	ctx, d.cancel = context.WithCancel(ctx)
	for i, s := range d.srvs {
		go func() { d.errs <- s.Serve(ctx, lns[i]) }() // Serve closes the listener
	}
	return d, nil
}

// wait returns when every double has stopped (stopping all of them when
// one fails) with the first error.
func (d *doubles) wait() error {
	var err error
	for range d.srvs {
		if e := <-d.errs; e != nil && err == nil {
			err = e
			d.cancel()
		}
	}
	for _, s := range d.srvs {
		s.Close()
	}
	return err
}

// stop shuts every double down and waits for it.
func (d *doubles) stop() error {
	d.cancel()
	return d.wait()
}

// serveDoubles serves doubles on addrs until ctx is done, logging each.
func serveDoubles(ctx context.Context, cfg double.Config, addrs []string) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	d, err := startDoubles(ctx, cfg, addrs)
	if err != nil {
		return err
	}
	model := cfg.ModelPath
	switch {
	case d.srvs[0].Config().LoadFormat == double.LoadFormatDummy:
		model = fmt.Sprintf("dummy weights, seed %d (--model is not read)", cfg.Seed)
	case model == "":
		model = fmt.Sprintf("untrained bigram, seed %d (demo-train --init random:%d)", cfg.Seed, cfg.Seed)
	}
	for i, s := range d.srvs {
		eff := s.Config()
		log.Info(doubleBanner, "url", d.urls[i], "generation", eff.Generation, "backend", eff.Backend,
			"load_format", eff.LoadFormat, "dev_mode", eff.DevMode, "model", model, "latency", eff.Latency, "slots", eff.MaxConcurrent)
		if host, _, _ := net.SplitHostPort(strings.TrimPrefix(d.urls[i], "http://")); !isLoopback(host) {
			log.Warn("the double listens beyond loopback; it has no authentication unless --api-key-env is set", "url", d.urls[i])
		}
	}
	err = d.wait()
	log.Info("vLLM double stopped")
	return err
}

func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
