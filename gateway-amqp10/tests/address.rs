//! RabbitMQ 4's v2 addresses: each form parses, names round-trip through percent-encoding,
//! and the v1 forms, bad encodings and the default exchange are refused with a typed error.

use proptest::prelude::*;
use warren_amqp10::address::{
    self, AddressError, Route, Source, Target, exchange_address, parse_source, parse_target,
    queue_address,
};

fn route(exchange: &str, routing_key: &str) -> Route {
    Route {
        exchange: exchange.into(),
        routing_key: routing_key.into(),
    }
}

#[test]
fn targets() {
    let t = parse_target(Some("/exchanges/amq.topic/a.b")).expect("parses");
    assert_eq!(
        t.route(None, Some("ignored")),
        Ok(route("amq.topic", "a.b"))
    );
    let t = parse_target(Some("/exchanges/logs")).expect("parses");
    assert_eq!(t.route(None, Some("k1")), Ok(route("logs", "k1")));
    assert_eq!(t.route(None, None), Ok(route("logs", "")));
    let t = parse_target(Some("/queues/q%2F1")).expect("parses");
    assert_eq!(t, Target::Queue("q/1".into()));
    assert_eq!(t.route(None, None), Ok(route("", "q/1")));
    // The null address: each message's `to`.
    let t = parse_target(None).expect("null");
    assert_eq!(t, Target::PerMessage);
    assert_eq!(t.route(Some("/queues/q9"), None), Ok(route("", "q9")));
    assert_eq!(
        t.route(Some("/exchanges/x/r%20k"), None),
        Ok(route("x", "r k"))
    );
    assert_eq!(t.route(None, None), Err(AddressError::MissingTo));
    assert!(matches!(
        t.route(Some("q9"), None),
        Err(AddressError::Format(_))
    ));
}

#[test]
fn sources() {
    assert_eq!(
        parse_source(Some("/queues/orders")),
        Ok(Source::Queue("orders".into()))
    );
    for bad in [Some("/exchanges/x"), Some("/exchanges/x/k"), None] {
        assert!(
            matches!(parse_source(bad), Err(AddressError::NotASource(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn refused() {
    for bad in [
        "q1",
        "/queue/q1",
        "/exchange/x/k",
        "/amq/queue/q",
        "/queues/",
        "/queues/a/b",
        "/exchanges/x/k/extra",
        "/topic/a",
        "",
    ] {
        let e = parse_target(Some(bad)).expect_err(bad);
        assert!(matches!(e, AddressError::Format(_)), "{bad}: {e:?}");
        assert_eq!(e.condition(), "amqp:invalid-field");
    }
    for bad in ["/queues/%zz", "/queues/%4", "/queues/%ff"] {
        assert!(
            matches!(parse_target(Some(bad)), Err(AddressError::Encoding(_))),
            "{bad}"
        );
    }
    assert!(matches!(
        parse_target(Some("/exchanges/amq.default/q")),
        Err(AddressError::DefaultExchange(_))
    ));
}

#[test]
fn encoding_is_rabbitmqs() {
    assert_eq!(queue_address("my queue/1"), "/queues/my%20queue%2F1");
    assert_eq!(
        exchange_address("amq.direct", Some("ä")),
        "/exchanges/amq.direct/%C3%A4"
    );
    assert_eq!(exchange_address("x", None), "/exchanges/x");
    assert_eq!(address::encode("a-b.c_d~e"), "a-b.c_d~e");
}

proptest! {
    #[test]
    fn any_name_round_trips(q in "\\PC{1,30}", x in "\\PC{1,30}", k in "\\PC{0,30}") {
        prop_assume!(x != "amq.default");
        prop_assert_eq!(
            parse_source(Some(&queue_address(&q))),
            Ok(Source::Queue(q.clone()))
        );
        let t = parse_target(Some(&exchange_address(&x, Some(&k)))).expect("parses");
        prop_assert_eq!(t.route(None, None), Ok(route(&x, &k)));
    }
}
