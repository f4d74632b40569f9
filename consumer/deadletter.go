package consumer

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

// deadLetterScript moves an entry to the dead-letter stream and acknowledges it.
var (
	//go:embed deadletter.lua
	deadLetterSrc    string
	deadLetterScript = redis.NewScript(deadLetterSrc)
)
