# Inputs of the global plane: etcd, the controller replicas and their admin API, and the
# authoritative DNS server the controller steers. README.md has the table.

variable "namespace" {
  type        = string
  description = "Kubernetes namespace created for the global plane."
  default     = "meridian-global"

  validation {
    condition     = can(regex("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", var.namespace)) && var.namespace != "default"
    error_message = "namespace must be a DNS label (lowercase letters, digits, dashes, at most 63) other than \"default\"."
  }
}

variable "regions" {
  type = list(object({
    id        = string
    geo       = string
    residency = list(string)
    backups   = list(string)
    lat       = number
    lon       = number
  }))
  description = "Every region, as the controller's [[regions]]: id, geography, residency tags, backups in order of preference, coordinates."

  validation {
    condition     = length(var.regions) > 0 && alltrue([for r in var.regions : can(regex("^[a-z0-9][a-z0-9-]{0,62}$", r.id))])
    error_message = "Each regions[].id must be 1-63 lowercase letters, digits and dashes, starting with a letter or digit (e.g. eu-west)."
  }
  validation {
    condition     = alltrue([for r in var.regions : can(regex("^[a-z0-9][a-z0-9-]{0,31}$", r.geo))])
    error_message = "Each regions[].geo must be 1-32 lowercase letters, digits and dashes (e.g. eu)."
  }
  validation {
    condition     = alltrue(flatten([for r in var.regions : [for tag in r.residency : can(regex("^[a-z0-9][a-z0-9-]{0,31}$", tag))]]))
    error_message = "Each residency tag in regions[].residency must be 1-32 lowercase letters, digits and dashes (e.g. eu)."
  }
  validation {
    condition     = alltrue(flatten([for r in var.regions : [for b in r.backups : b != r.id && contains([for o in var.regions : o.id], b)]]))
    error_message = "Each regions[].backups entry must be the id of another region of regions (a region cannot back itself up)."
  }
  validation {
    condition = alltrue(flatten([
      for r in var.regions : [
        for b in r.backups : length(setsubtract(r.residency, flatten([for o in var.regions : o.residency if o.id == b]))) == 0
      ]
    ]))
    error_message = "A backup must meet every residency tag of the region it backs up: pick a compliant backup (EU data never fails over to a region without \"eu\")."
  }
  validation {
    condition     = alltrue([for r in var.regions : r.lat >= -90 && r.lat <= 90 && r.lon >= -180 && r.lon <= 180])
    error_message = "regions[].lat must be within -90..90 and regions[].lon within -180..180."
  }
}

variable "latency_ms" {
  type        = map(map(number))
  description = "Round-trip latency between regions in ms, { from = { to = ms } }: automatic backups prefer the nearest compliant region."
  default     = {}

  validation {
    condition     = alltrue(flatten([for from, row in var.latency_ms : [for to, ms in row : ms >= 0]]))
    error_message = "Every latency_ms value must be >= 0 (milliseconds of round trip)."
  }
}

variable "etcd_replicas" {
  type        = number
  description = "Members of the etcd StatefulSet run here (ignored with etcd_external_endpoints): 3 tolerates one lost member, 5 two."
  default     = 3

  validation {
    condition     = contains([3, 5], var.etcd_replicas)
    error_message = "etcd_replicas must be 3 or 5: an odd number that keeps quorum when one (3) or two (5) members are lost."
  }
}

variable "etcd_external_endpoints" {
  type        = list(string)
  description = "Client URLs of an etcd cluster of your own (e.g. members spread over the regions), https:// only; empty: run etcd_replicas members here. The etcd TLS inputs then describe your cluster: etcd_ca_cert its CA, the client certificates issued by it."
  default     = []

  validation {
    condition     = alltrue([for url in var.etcd_external_endpoints : can(regex("^https://[^/?#]+/?$", url))])
    error_message = "Each etcd_external_endpoints entry must be an https://host:2379 URL: the controllers reach etcd over TLS only, verifying the members with etcd_ca_cert and presenting controller_etcd_cert."
  }
}

variable "etcd_ca_cert" {
  type        = string
  description = "PEM CA that signed the etcd members' certificates and every client certificate (root's, the controllers', each region's agents'): the members' --trusted-ca-file and --peer-trusted-ca-file, the controllers' etcd.ca_file, module region's etcd_ca_cert."

  validation {
    condition     = can(regex("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----", var.etcd_ca_cert))
    error_message = "etcd_ca_cert must be a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----)."
  }
}

variable "etcd_member_cert" {
  type        = string
  description = "PEM certificate of the etcd members, for clients and peers alike (extendedKeyUsage serverAuth and clientAuth), signed by etcd_ca_cert and naming outputs etcd_tls_dns_names and etcd_tls_ip_addresses. Required unless etcd_external_endpoints."
  default     = null

  validation {
    condition     = length(var.etcd_external_endpoints) > 0 || can(regex("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----", var.etcd_member_cert))
    error_message = "etcd_member_cert must be the members' PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----) unless etcd_external_endpoints is set: the members serve clients and peers over TLS only."
  }
}

variable "etcd_member_key" {
  type        = string
  description = "Unencrypted PEM private key of etcd_member_cert. Required unless etcd_external_endpoints."
  default     = null
  sensitive   = true

  validation {
    condition     = length(var.etcd_external_endpoints) > 0 || (can(regex("-----BEGIN ([A-Z]+ )?PRIVATE KEY-----", var.etcd_member_key)) && !can(regex("ENCRYPTED", var.etcd_member_key)))
    error_message = "etcd_member_key must be an unencrypted PEM private key (-----BEGIN PRIVATE KEY----- or -----BEGIN EC PRIVATE KEY-----) unless etcd_external_endpoints is set."
  }
}

variable "controller_etcd_cert" {
  type        = string
  description = "PEM client certificate of the controllers for etcd (etcd.cert_file), signed by etcd_ca_cert, CN meridian-controller: the etcd user whose role reads and writes everything under /meridian/v1/."

  validation {
    condition     = can(regex("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----", var.controller_etcd_cert))
    error_message = "controller_etcd_cert must be a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----) with CN meridian-controller."
  }
}

variable "controller_etcd_key" {
  type        = string
  description = "Unencrypted PEM private key of controller_etcd_cert (etcd.key_file)."
  sensitive   = true

  validation {
    condition     = can(regex("-----BEGIN ([A-Z]+ )?PRIVATE KEY-----", var.controller_etcd_key)) && !can(regex("ENCRYPTED", var.controller_etcd_key))
    error_message = "controller_etcd_key must be an unencrypted PEM private key (-----BEGIN PRIVATE KEY----- or -----BEGIN EC PRIVATE KEY-----): the controller reads it without a passphrase."
  }
}

variable "etcd_root_cert" {
  type        = string
  description = "PEM client certificate with CN root, signed by etcd_ca_cert: only the etcd-bootstrap Job uses it, to create the roles and users (`meridian-controller etcd bootstrap`) and enable auth."

  validation {
    condition     = can(regex("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----", var.etcd_root_cert))
    error_message = "etcd_root_cert must be a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----) with CN root."
  }
}

variable "etcd_root_key" {
  type        = string
  description = "Unencrypted PEM private key of etcd_root_cert, mounted into the etcd-bootstrap Job's pod only."
  sensitive   = true

  validation {
    condition     = can(regex("-----BEGIN ([A-Z]+ )?PRIVATE KEY-----", var.etcd_root_key)) && !can(regex("ENCRYPTED", var.etcd_root_key))
    error_message = "etcd_root_key must be an unencrypted PEM private key (-----BEGIN PRIVATE KEY----- or -----BEGIN EC PRIVATE KEY-----): the bootstrap reads it without a passphrase."
  }
}

variable "etcd_image" {
  type        = string
  description = "etcd's image, pinned by digest, e.g. gcr.io/etcd-development/etcd@sha256:<64 hex> (v3.5.1 or later: the readiness probe's /health answers with auth enabled)."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.etcd_image))
    error_message = "etcd_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "etcd_storage_size" {
  type        = string
  description = "Persistent volume of each etcd member, e.g. 20Gi (Meridian's keyspace is small; etcd's default quota is 2 GiB)."
  default     = "20Gi"

  validation {
    condition     = can(regex("^[0-9]+(Mi|Gi|Ti)$", var.etcd_storage_size))
    error_message = "etcd_storage_size must be a quantity in Mi, Gi or Ti (e.g. 20Gi)."
  }
}

variable "etcd_load_balancer_ip" {
  type        = string
  description = "Address of an internal LoadBalancer in front of the etcd members here, for the other regions' agents; null: no such Service (agents in this cluster only)."
  default     = null

  validation {
    condition     = var.etcd_load_balancer_ip == null || can(cidrhost("${coalesce(var.etcd_load_balancer_ip, "0.0.0.0")}/32", 0)) || can(cidrhost("${coalesce(var.etcd_load_balancer_ip, "::")}/128", 0))
    error_message = "etcd_load_balancer_ip must be an IPv4 or IPv6 address, or null."
  }
}

variable "internal_load_balancer_annotations" {
  type        = map(string)
  description = "Annotations that make a LoadBalancer internal on your cloud (etcd and the admin API must never be public), e.g. { \"networking.gke.io/load-balancer-type\" = \"Internal\" }."
  default     = {}
}

variable "storage_class_name" {
  type        = string
  description = "Storage class of etcd's and BIND's volumes; null: the cluster's default."
  default     = null
}

variable "controller_image" {
  type        = string
  description = "Meridian's image (deploy/container/Containerfile), pinned by digest."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.controller_image))
    error_message = "controller_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "controller_replicas" {
  type        = number
  description = "Controller replicas (one leads; the others take over within election.lease_ttl_s). 3 is usual."
  default     = 3

  validation {
    condition     = var.controller_replicas >= 1 && floor(var.controller_replicas) == var.controller_replicas
    error_message = "controller_replicas must be a whole number of at least 1 (3 to survive a lost node during an upgrade)."
  }
}

variable "read_port" {
  type        = number
  description = "The controllers' read port (server.port): GET /health and the admin API's reads, plain HTTP."
  default     = 8090

  validation {
    condition     = var.read_port >= 1024 && var.read_port <= 65535 && floor(var.read_port) == var.read_port
    error_message = "read_port must be a whole number from 1024 to 65535 (the pods run without privileges)."
  }
}

variable "admin_port" {
  type        = number
  description = "The controllers' admin port (api.port): the admin API over HTTPS."
  default     = 8091

  validation {
    condition     = var.admin_port >= 1024 && var.admin_port <= 65535 && floor(var.admin_port) == var.admin_port && var.admin_port != var.read_port
    error_message = "admin_port must be a whole number from 1024 to 65535, other than read_port."
  }
}

variable "admin_load_balancer_ip" {
  type        = string
  description = "Address of the internal LoadBalancer of the admin API (meridianctl's MERIDIAN_URL); null: ClusterIP only (reach it with kubectl port-forward)."
  default     = null

  validation {
    condition     = var.admin_load_balancer_ip == null || can(cidrhost("${coalesce(var.admin_load_balancer_ip, "0.0.0.0")}/32", 0)) || can(cidrhost("${coalesce(var.admin_load_balancer_ip, "::")}/128", 0))
    error_message = "admin_load_balancer_ip must be an IPv4 or IPv6 address, or null."
  }
}

variable "admin_tls_cert" {
  type        = string
  description = "PEM certificate (chain) of the admin API. It must name every replica, *.meridian-controller-peers.<namespace>.svc.cluster.local, and the admin Service (output admin_tls_dns_names), and carry admin_load_balancer_ip as an IP address (output admin_tls_ip_addresses)."

  validation {
    condition     = startswith(trimspace(var.admin_tls_cert), "-----BEGIN CERTIFICATE-----")
    error_message = "admin_tls_cert must be a PEM certificate (-----BEGIN CERTIFICATE-----...)."
  }
}

variable "admin_tls_key" {
  type        = string
  description = "PEM private key of admin_tls_cert."
  sensitive   = true

  validation {
    condition     = can(regex("^-----BEGIN ([A-Z]+ )?PRIVATE KEY-----", trimspace(var.admin_tls_key)))
    error_message = "admin_tls_key must be a PEM private key (-----BEGIN PRIVATE KEY-----...)."
  }
}

variable "admin_tls_ca" {
  type        = string
  description = "PEM CA bundle a replica trusts when it forwards a write to the leader (api.tls.ca_file); empty: admin_tls_cert itself."
  default     = ""
}

variable "admin_tokens" {
  type = list(object({
    name   = string
    role   = string
    sha256 = string
  }))
  description = "Bearer tokens of the admin API, as SHA-256 hashes: `meridianctl token new --name <who> --role <role>` prints a token and its entry."

  validation {
    condition     = alltrue([for t in var.admin_tokens : can(regex("^[0-9a-f]{64}$", t.sha256))])
    error_message = "Each admin_tokens[].sha256 must be 64 lowercase hex digits: the SHA-256 of the token, never the token (meridianctl token new prints it)."
  }
  validation {
    condition     = alltrue([for t in var.admin_tokens : contains(["viewer", "operator", "admin"], t.role)])
    error_message = "Each admin_tokens[].role must be viewer, operator or admin."
  }
  validation {
    condition     = length(distinct([for t in var.admin_tokens : t.name])) == length(var.admin_tokens) && alltrue([for t in var.admin_tokens : length(t.name) >= 1 && length(t.name) <= 64])
    error_message = "admin_tokens[].name must be 1-64 characters and unique: it names the caller in the audit log."
  }
}

variable "dns_zone" {
  type        = string
  description = "The zone the controller steers, absolute, e.g. meridian.example. (clients resolve api.<zone>)."

  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+$", var.dns_zone))
    error_message = "dns_zone must be an absolute DNS name in lowercase, ending with a dot (e.g. meridian.example.)."
  }
}

variable "dns_views" {
  type = list(object({
    name          = string
    geo           = string
    match_clients = list(string)
  }))
  description = "One view per geography in BIND's match order: name, geo, BIND address-match elements (resolver subnets, or geoip ACLs with a GeoIP-enabled BIND); the last with [] matches everyone else."

  validation {
    condition     = length(var.dns_views) > 0 && alltrue([for v in var.dns_views : can(regex("^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", v.name))]) && length(distinct([for v in var.dns_views : v.name])) == length(var.dns_views)
    error_message = "dns_views needs at least one view; each name 1-63 letters, digits, '.', '_' or '-', and unique."
  }
  validation {
    condition     = alltrue([for v in var.dns_views : can(regex("^[a-z0-9][a-z0-9-]{0,31}$", v.geo))])
    error_message = "Each dns_views[].geo must be a geography of regions (1-32 lowercase letters, digits and dashes)."
  }
}

variable "dns_ttl_s" {
  type        = number
  description = "TTL of every steered record, seconds (dns.ttl_s): how long resolvers may keep an answer after a failover."
  default     = 30

  validation {
    condition     = var.dns_ttl_s >= 0 && var.dns_ttl_s <= 86400 && floor(var.dns_ttl_s) == var.dns_ttl_s
    error_message = "dns_ttl_s must be a whole number of seconds from 0 to 86400 (30 matches the health window)."
  }
}

variable "tsig_secret" {
  type        = string
  description = "TSIG secret (base64, at least 16 random bytes) shared by the views' keys meridian-<view>: `tsig-keygen -a hmac-sha256 meridian` prints one."
  sensitive   = true

  validation {
    # Not can(base64decode(...)): base64decode fails on bytes that are not UTF-8, which a
    # random secret's are, so it would refuse every secret tsig-keygen prints.
    condition     = can(regex("^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$", var.tsig_secret)) && length(var.tsig_secret) >= 24
    error_message = "tsig_secret must be base64 of at least 16 random bytes (24 characters or more): use `tsig-keygen -a hmac-sha256 meridian`."
  }
}

variable "external_dns_server" {
  type        = string
  description = "Address of an existing RFC 2136 server (with the views and keys of `meridian-controller dns bind-config`); null: run BIND9 here."
  default     = null

  validation {
    condition     = var.external_dns_server == null || can(cidrhost("${coalesce(var.external_dns_server, "0.0.0.0")}/32", 0)) || can(cidrhost("${coalesce(var.external_dns_server, "::")}/128", 0))
    error_message = "external_dns_server must be an IPv4 or IPv6 address (the controller's dns.server takes no host name), or null."
  }
}

variable "bind_image" {
  type        = string
  description = "BIND9's image, pinned by digest, e.g. docker.io/internetsystemsconsortium/bind9@sha256:<64 hex> (9.18)."
  default     = null

  validation {
    condition     = var.bind_image == null || can(regex("@sha256:[0-9a-f]{64}$", coalesce(var.bind_image, "-")))
    error_message = "bind_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "bind_cluster_ip" {
  type        = string
  description = "Fixed cluster IP of the BIND Service (inside the cluster's service range): the controller's dns.server, which must be an address."
  default     = null

  validation {
    condition     = var.bind_cluster_ip == null || can(cidrhost("${coalesce(var.bind_cluster_ip, "0.0.0.0")}/32", 0)) || can(cidrhost("${coalesce(var.bind_cluster_ip, "::")}/128", 0))
    error_message = "bind_cluster_ip must be an IPv4 or IPv6 address inside the cluster's service range, or null."
  }
}

variable "dns_load_balancer_ip" {
  type        = string
  description = "Public address reserved for BIND's LoadBalancer (UDP and TCP 53): the glue of the delegation."
  default     = null

  validation {
    condition     = var.dns_load_balancer_ip == null || can(cidrhost("${coalesce(var.dns_load_balancer_ip, "0.0.0.0")}/32", 0)) || can(cidrhost("${coalesce(var.dns_load_balancer_ip, "::")}/128", 0))
    error_message = "dns_load_balancer_ip must be an IPv4 or IPv6 address, or null."
  }
}

variable "dns_nameservers" {
  type = list(object({
    name    = string
    address = string
  }))
  description = "The zone's name servers for its NS records and the registrar's delegation: the BIND here first (dns_load_balancer_ip), then any secondaries you run."

  validation {
    condition     = length(var.dns_nameservers) > 0 && alltrue([for ns in var.dns_nameservers : can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+$", ns.name))])
    error_message = "dns_nameservers needs at least one entry; each name an absolute lowercase DNS name ending with a dot (e.g. ns1.meridian.example.)."
  }
  validation {
    condition     = alltrue([for ns in var.dns_nameservers : can(cidrhost("${ns.address}/32", 0)) || can(cidrhost("${ns.address}/128", 0))])
    error_message = "Each dns_nameservers[].address must be an IPv4 or IPv6 address (the glue record)."
  }
}

variable "hostmaster" {
  type        = string
  description = "The zone's SOA contact as a DNS name (hostmaster.meridian.example. for hostmaster@meridian.example)."

  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+$", var.hostmaster))
    error_message = "hostmaster must be an absolute lowercase DNS name ending with a dot (hostmaster.meridian.example.)."
  }
}

variable "controller_resources" {
  type = object({
    cpu    = string
    memory = string
  })
  description = "CPU and memory of one controller pod (requests = limits)."
  default = {
    cpu    = "1"
    memory = "512Mi"
  }
}

variable "etcd_resources" {
  type = object({
    cpu    = string
    memory = string
  })
  description = "CPU and memory of one etcd member (requests = limits)."
  default = {
    cpu    = "1"
    memory = "2Gi"
  }
}
