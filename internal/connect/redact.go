package connect

import (
	"regexp"
	"strings"
)

// Secrets are scrubbed from text by shape, without parsing it: a URL that
// fails to parse (a bad port, a stray character) is exactly the one an error
// message quotes back, password included.
var (
	// scheme://user:password@host — the password runs to the last '@' of
	// the whitespace-free token (an unescaped '@' may be part of it).
	urlPassword = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@]*:)[^\s]*@`)
	// password=... in a query string or a key=value DSN (also sslpassword,
	// and spaces around '='), the value bare or single-quoted with escapes.
	keyPassword = regexp.MustCompile(`(?i)((?:^|[\s?&;,"'(\x60])(?:ssl)?pass(?:word)?\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&;,"')\x60]*)`)
	// Redis AUTH arguments as a command line would show them.
	authArgs = regexp.MustCompile(`(?i)(\bAUTH\s+)(\S+\s+)?\S+`)
)

// RedactSecrets returns s with every credential it can recognize replaced by
// "xxxxx": the password of any URL's user info, password= parameters of URL
// queries and key=value connection strings, and the arguments of an AUTH
// command. It never fails and needs no valid input, so it is safe on error
// messages and log lines of any origin.
func RedactSecrets(s string) string {
	if s == "" {
		return s
	}
	// Each shape has a marker that text without credentials seldom holds:
	// without it, its regular expression (most of what a log line costs
	// when every attribute goes through here) cannot match and is skipped.
	if strings.Contains(s, "://") && strings.Contains(s, "@") {
		s = urlPassword.ReplaceAllString(s, "${1}xxxxx@")
	}
	if strings.Contains(s, "=") && containsFold(s, "pass") {
		s = redactKeyPasswords(s)
	}
	if containsFold(s, "auth") {
		s = authArgs.ReplaceAllString(s, "${1}xxxxx")
	}
	return s
}

// containsFold reports whether s holds sub, an ASCII lower-case word, in
// any case; text that is not all ASCII may hold it under Unicode's case
// folding (the regular expressions' (?i)), so it always may.
func containsFold(s, sub string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return true
		}
	}
	for i := 0; i+len(sub) <= len(s); i++ {
		if strings.EqualFold(s[i:i+len(sub)], sub) {
			return true
		}
	}
	return false
}

// redactKeyPasswords scrubs the values of password= parameters.
func redactKeyPasswords(s string) string {
	return keyPassword.ReplaceAllStringFunc(s, func(m string) string {
		sub := keyPassword.FindStringSubmatch(m)
		// A bare value that ends the clause of a message ("password=x: ...")
		// keeps the colon: it is punctuation more likely than password.
		tail := ""
		if v := sub[2]; !strings.HasPrefix(v, "'") && strings.HasSuffix(v, ":") {
			tail = ":"
		}
		return sub[1] + "xxxxx" + tail
	})
}

// passwordsIn returns the passwords written in raw (a URL or a key=value
// connection string), parsed or not, so that text quoting them some other
// way (a driver's message, percent-decoded) can be scrubbed too.
func passwordsIn(raw string) []string {
	var out []string
	add := func(p string) {
		p = strings.Trim(p, "'")
		if len(p) >= 3 { // shorter would blank out unrelated text
			out = append(out, p)
		}
	}
	for _, m := range urlPassword.FindAllString(raw, -1) {
		if i := strings.Index(m, "://"); i >= 0 {
			userinfo := strings.TrimSuffix(m[i+3:], "@")
			if _, p, ok := strings.Cut(userinfo, ":"); ok {
				add(p)
				if dec, err := unescape(p); err == nil {
					add(dec)
				}
			}
		}
	}
	for _, m := range keyPassword.FindAllStringSubmatch(raw, -1) {
		add(m[2])
		if dec, err := unescape(m[2]); err == nil {
			add(dec)
		}
	}
	return out
}
