package connect_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/testenv"
)

// TLS to PostgreSQL is asked for in the URL (sslmode): against a server
// without TLS, sslmode=require fails; once the server has a certificate, the
// session is encrypted. The test owns its server.
func TestPostgresTLSThroughTheURL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg, err := testenv.LocalPostgres(ctx, testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	require := withSSLMode(pg.URL, "require")

	if pool, err := connect.Postgres(ctx, require, connect.PostgresOptions{AppName: "outbox-tls-test"}); err == nil {
		pool.Close()
		t.Fatal("sslmode=require reached a server without TLS")
	}

	// Give the server a certificate, owned like its data directory, and turn
	// TLS on with a reload.
	dir := pg.Dir()
	certFile, keyFile := writeCert(t, dir)
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{certFile, keyFile} {
		if err := os.Chown(f, int(st.Uid), int(st.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	admin, err := connect.Postgres(ctx, pg.URL, connect.PostgresOptions{AppName: "outbox-tls-admin"})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	for _, q := range []string{
		"ALTER SYSTEM SET ssl_cert_file = '" + certFile + "'",
		"ALTER SYSTEM SET ssl_key_file = '" + keyFile + "'",
		"ALTER SYSTEM SET ssl = on",
		"SELECT pg_reload_conf()",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// The reload is asynchronous: wait until a new session sees TLS on.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var on string
		p, err := connect.Postgres(ctx, pg.URL, connect.PostgresOptions{AppName: "outbox-tls-admin"})
		if err == nil {
			err = p.QueryRow(ctx, "SHOW ssl").Scan(&on)
			p.Close()
		}
		if on == "on" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ssl is %q 10 s after the reload (%v)", on, err)
		}
	}

	pool, err := connect.Postgres(ctx, require, connect.PostgresOptions{AppName: "outbox-tls-test"})
	if err != nil {
		t.Fatalf("sslmode=require against a server with TLS: %v", err)
	}
	defer pool.Close()
	var ssl bool
	if err := pool.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil || !ssl {
		t.Fatalf("session encrypted: %v, %v; want true", ssl, err)
	}
}

// TLS to Redis is asked for with rediss://; a plain redis:// client cannot
// talk to a TLS port.
func TestRedisTLSThroughTheURL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "outbox-redis-tls-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil { // the server may run as another user
		t.Fatal(err)
	}
	certFile, keyFile := writeCert(t, dir)
	if err := os.Chmod(keyFile, 0o644); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	rds, err := testenv.LocalRedis(ctx, testenv.Options{ExtraArgs: []string{
		"--tls-port", strconv.Itoa(port), "--tls-cert-file", certFile, "--tls-key-file", keyFile,
		"--tls-auth-clients", "no",
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer rds.Close()
	addr := "127.0.0.1:" + strconv.Itoa(port)

	rdb, err := connect.Redis(ctx, "rediss://"+addr+"/0?skip_verify=true", connect.RedisOptions{ClientName: "outbox-tls-test"})
	if err != nil {
		t.Fatalf("rediss:// to the TLS port: %v", err)
	}
	defer rdb.Close()
	if err := rdb.Set(ctx, "outbox-tls-test", "ok", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if plain, err := connect.Redis(ctx, "redis://"+addr+"/0", connect.RedisOptions{ClientName: "outbox-tls-test"}); err == nil {
		plain.Close()
		t.Fatal("a plain redis:// client talked to the TLS port")
	}
}

func withSSLMode(u, mode string) string {
	if i := strings.Index(u, "sslmode="); i >= 0 {
		end := strings.IndexByte(u[i:], '&')
		if end < 0 {
			return u[:i] + "sslmode=" + mode
		}
		return u[:i] + "sslmode=" + mode + u[i+end:]
	}
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "sslmode=" + mode
}

// writeCert writes a self-signed certificate for 127.0.0.1 and its key
// (mode 0600) into dir.
func writeCert(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "localhost"},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
