package pipelines

import (
	"fmt"
	"strings"
)

// suggest returns the candidate closest to s by edit distance (adjacent
// transpositions count once), or "" when none is close enough to be a typo:
// one edit for short names, two from six characters, three from twelve. A
// candidate that s extends or shortens ("boolean", "bool") also counts.
func suggest(s string, candidates []string) string {
	// Below three characters every candidate looks like a typo; long inputs
	// are never typos of short names, and the distance is quadratic.
	if len(s) < 3 || len(s) > 64 {
		return ""
	}
	limit := 1
	switch {
	case len(s) >= 12:
		limit = 3
	case len(s) >= 6:
		limit = 2
	}
	best, bestD := "", limit+1
	for _, c := range candidates {
		if c == s || len(c) > 64 {
			continue
		}
		d := editDistance(s, c)
		if len(c) >= 3 && (strings.HasPrefix(s, c) || strings.HasPrefix(c, s)) {
			d = min(d, limit)
		}
		if d < bestD {
			best, bestD = c, d
		}
	}
	return best
}

// didYouMean formats suggest's answer as a message suffix.
func didYouMean(s string, candidates []string) string {
	if c := suggest(s, candidates); c != "" {
		return fmt.Sprintf(" (did you mean %q?)", c)
	}
	return ""
}

// editDistance is the optimal string alignment distance over bytes.
func editDistance(a, b string) int {
	prev2 := make([]int, len(b)+1)
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}

// joinNames lists names for a message: "a, b, c".
func joinNames(names []string) string {
	return strings.Join(names, ", ")
}
