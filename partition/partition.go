// Package partition maps partition keys to the partitions of an event stream
// and names the Redis keys of each partition.
//
// Events with one partition key (for transfer.settled, the sender account)
// go to one partition and keep their order there. A deployment has a fixed
// number of partitions N (relay and consumers must agree on it); N = 1 is
// one stream under its plain name, as before partitions existed.
//
// The mapping is a contract between processes and languages, so it is spelled
// out: a key's partition is the first four bytes of the MD5 digest of its
// UTF-8 bytes, read as a big-endian unsigned integer, modulo N. In PostgreSQL:
//
//	(('x' || substr(md5(key), 1, 8))::bit(32)::bigint) % n
//
// Partition p of N > 1 lives under the Redis Cluster hash tag Tag(p, N), so
// its stream and every key of the consumer state its events touch hash to one
// slot (one node), and a Lua script may touch them all.
package partition

import (
	"crypto/md5"
	"encoding/binary"
	"fmt"
	"strconv"
	"sync"
)

// Max is the most partitions a deployment may have.
const Max = 1024

// Of returns the partition of key among n partitions (0 when n <= 1).
func Of(key string, n int) int {
	if n <= 1 {
		return 0
	}
	sum := md5.Sum([]byte(key))
	return int(uint64(binary.BigEndian.Uint32(sum[:4])) % uint64(n))
}

// Validate reports whether n is a usable number of partitions.
func Validate(n int) error {
	if n < 1 || n > Max {
		return fmt.Errorf("partitions %d: must be between 1 and %d", n, Max)
	}
	return nil
}

// Stream is the stream key of partition p of the stream base: base itself
// when n is 1, else base:{tag}.
func Stream(base string, p, n int) string {
	if n <= 1 {
		return base
	}
	return base + ":{" + Tag(p, n) + "}"
}

// Streams is every partition's stream key of base, by partition.
func Streams(base string, n int) []string {
	keys := make([]string, max(n, 1))
	for p := range keys {
		keys[p] = Stream(base, p, n)
	}
	return keys
}

// Prefix is the key prefix of partition p's state under prefix: prefix
// itself when n is 1, else prefix{tag}: (so prefix "fraud:" becomes
// "fraud:{p3}:" for partition 3 of 4).
func Prefix(prefix string, p, n int) string {
	if n <= 1 {
		return prefix
	}
	return prefix + "{" + Tag(p, n) + "}:"
}

// Slots is how many hash slots a Redis Cluster has.
const Slots = 16384

// Tag is partition p's Redis Cluster hash tag among n partitions: "p<p>" or,
// when that would not do, "p<p>.<k>" with the smallest k > 0 that does. It
// does when the tag's slot lies in the p-th of n equal ranges of the slot
// space, so the partitions spread evenly over the slot ranges that
// redis-cli --cluster create assigns to the masters (contiguous and equal),
// instead of where CRC16 happens to put p0, p1, ...
func Tag(p, n int) string {
	if n < 1 || n > Max || p < 0 || p >= n {
		panic(fmt.Sprintf("partition.Tag(%d, %d): no such partition", p, n))
	}
	if t, ok := tagCache.Load(n); ok {
		return t.([]string)[p]
	}
	t := make([]string, n)
	for i := range t {
		t[i] = findTag(i, n)
	}
	tagCache.Store(n, t)
	return t[p]
}

// tagCache holds every partition's tag by n: the relay names a stream for
// each event it publishes.
var tagCache sync.Map

func findTag(p, n int) string {
	lo, hi := p*Slots/n, (p+1)*Slots/n
	for k := 0; ; k++ {
		tag := "p" + strconv.Itoa(p)
		if k > 0 {
			tag += "." + strconv.Itoa(k)
		}
		if s := Slot(tag); s >= lo && s < hi {
			return tag
		}
	}
}

// Slot is the Redis Cluster hash slot of key: CRC16 (XMODEM) of the key, or
// of its hash tag when it has one, modulo 16384.
func Slot(key string) int {
	for i := 0; i < len(key); i++ {
		if key[i] != '{' {
			continue
		}
		for j := i + 1; j < len(key); j++ {
			if key[j] == '}' {
				if j > i+1 {
					key = key[i+1 : j]
				}
				return int(crc16(key)) % Slots
			}
		}
		break
	}
	return int(crc16(key)) % Slots
}

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum
// Redis Cluster hashes keys with.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}
