// gie-scrape reads a quiver /metrics endpoint with the Gateway API Inference Extension's own
// model-server scraping code (pkg/epp/backend/metrics, the client the endpoint picker runs with
// its default vLLM metric names) and prints what the endpoint picker would see, as JSON.
//
// Usage: gie-scrape -host 127.0.0.1:8080 [-path /metrics]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/go-logr/logr"

	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/backend/metrics"
	fwkdl "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/datalayer"
)

// scraped is the part of the endpoint picker's view of a model server that quiver feeds.
type scraped struct {
	WaitingQueueSize    int      `json:"waiting_queue_size"`
	RunningRequestsSize int      `json:"running_requests_size"`
	KVCacheUsagePercent float64  `json:"kv_cache_usage_percent"`
	MaxActiveModels     int      `json:"max_active_models"`
	ActiveModels        []string `json:"active_models"`
	WaitingModels       []string `json:"waiting_models"`
	CacheBlockSize      int      `json:"cache_block_size"`
	CacheNumBlocks      int      `json:"cache_num_blocks"`
}

func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func main() {
	host := flag.String("host", "", "host:port of the model server")
	path := flag.String("path", "/metrics", "metrics path")
	flag.Parse()
	if *host == "" {
		fmt.Fprintln(os.Stderr, "gie-scrape: -host is required")
		os.Exit(2)
	}
	// The endpoint picker's defaults (pkg/epp/server/options.go): the names vLLM exports.
	client, err := metrics.NewPodMetricsClientImpl(logr.Discard(), metrics.Config{
		ModelServerMetricsScheme:     "http",
		ModelServerMetricsPath:       *path,
		TotalQueuedRequestsMetric:    "vllm:num_requests_waiting",
		TotalRunningRequestsMetric:   "vllm:num_requests_running",
		KVCacheUsagePercentageMetric: "vllm:kv_cache_usage_perc",
		LoRAInfoMetric:               "vllm:lora_requests_info",
		CacheInfoMetric:              "vllm:cache_config_info",
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "gie-scrape: metric mapping:", err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	endpoint := &fwkdl.EndpointMetadata{PodName: "quiver", MetricsHost: *host}
	state, err := client.FetchMetrics(ctx, endpoint, fwkdl.NewMetrics())
	if err != nil {
		// The picker keeps what it could read but reports the error; so do we, and fail.
		fmt.Fprintln(os.Stderr, "gie-scrape: fetch:", err)
		os.Exit(1)
	}
	out := scraped{
		WaitingQueueSize:    state.WaitingQueueSize,
		RunningRequestsSize: state.RunningRequestsSize,
		KVCacheUsagePercent: state.KVCacheUsagePercent,
		MaxActiveModels:     state.MaxActiveModels,
		ActiveModels:        sortedKeys(state.ActiveModels),
		WaitingModels:       sortedKeys(state.WaitingModels),
		CacheBlockSize:      state.CacheBlockSize,
		CacheNumBlocks:      state.CacheNumBlocks,
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
